"""``python -m megafixed.eval.lm_eval_cli run --model megafixed --model_args checkpoint=RUN --tasks hellaswag``:
lm-evaluation-harness's own command line with the ``megafixed`` model registered.

lm-eval 0.4 discovers models only by import (``@register_model``; no entry points), and
``--include_path`` adds *task* folders, not models: so this wrapper imports the harness's built-in
models (``--model hf`` keeps working) and our adapter, then hands over to ``lm_eval``'s CLI.
Needs ``pip install lm-eval`` (and the harness fetches its task data from the Hugging Face hub).
"""
from __future__ import annotations


def main() -> None:
    import lm_eval.models  # noqa: F401 -- the built-in models, before ours makes the registry non-empty
    from lm_eval.__main__ import cli_evaluate

    from . import lm_eval_adapter  # noqa: F401 -- registers "megafixed"

    cli_evaluate()


if __name__ == "__main__":
    main()
