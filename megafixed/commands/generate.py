"""``megafixed generate RUN --prompt TEXT``: look at what a trained model says.

Greedy by default; ``--temperature T`` (> 0) samples, with ``--top-p`` nucleus filtering and a
``--seed``. Tokens are printed as they are generated (a key/value cache makes each one cheap).
The model is loaded through the one loading path, so any TP/PP/ZeRO checkpoint works.
"""
from __future__ import annotations

import sys

from ..trust.flag import add_trust_run_dir, check_source

HELP = "generate text from a trained run (greedy or top-p sampling, streamed to the terminal)"


def add_arguments(p):
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                   help="run directory, its checkpoints folder, or a tag directory under it")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the run's latest)")
    add_trust_run_dir(p)
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: the run's own)")
    p.add_argument("--no-stop", action="store_true",
                   help="do not stop at the end token (the model's eos_token_id if imported, else the tokenizer's EOD)")


class TextStream:
    """Print the decoded continuation as it grows. Decoding the whole continuation each time (not
    token by token) keeps multi-token characters intact; a trailing U+FFFD (half a UTF-8
    character) is held back until the rest arrives."""

    def __init__(self, tok, out=None):
        self.tok, self.out, self.ids, self.shown = tok, out or sys.stdout, [], 0

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)

    def finish(self) -> None:
        text = self.tok.decode(self.ids)
        self.out.write(text[self.shown:] + "\n")
        self.out.flush()


def run(args) -> int:
    import torch

    from ..model.generate import GenerationError, SamplingConfig, complete
    from ..threads import apply_thread_policy
    from ..train.run_source import resolve_run, run_tokenizer

    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed).validate()
    check_source(args.source, args)
    src = resolve_run(args.source, args.tag)
    tok = run_tokenizer(src.config, args.tokenizer)
    if tok is None:
        raise GenerationError(f"the run {src.run_dir} names no tokenizer; pass --tokenizer PATH")
    if not args.no_stop:
        from ..interop.hf_files import model_eos_ids

        # an imported model's own eos_token_id(s) (as transformers' generate stops), else the tokenizer's EOD
        sampling.stop_ids = tuple(model_eos_ids(src.run_dir)) or (tok.eod_id,)
    model = src.load_model()
    # Once the inputs are known good (a bad one stays a single error line); stderr: stdout is the text.
    apply_thread_policy(log=lambda m: print(m, file=sys.stderr), knob="OMP_NUM_THREADS=N")
    if torch.cuda.is_available():
        model = model.cuda()
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    stream = TextStream(tok)
    complete(model, tok, args.prompt, sampling, on_token=stream)  # the quickstart's samples' path too
    stream.finish()
    return 0
