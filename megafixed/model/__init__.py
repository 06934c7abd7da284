from .gpt import GPT, init_parameters  # noqa: F401
from .inputs import FixedCodeInput, LearnedInput, build_input  # noqa: F401
