from .gpt import GPT, init_parameters  # noqa: F401
from .inputs import FixedCodeInput, LearnedInput  # noqa: F401
from .interfaces import INTERFACES, InputInterface, build_input, interface_of  # noqa: F401
