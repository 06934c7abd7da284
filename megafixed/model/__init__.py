from .gpt import GPT, TP_PLAN  # noqa: F401
from .inputs import FixedCodeInput, LearnedInput, build_input  # noqa: F401
