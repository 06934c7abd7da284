"""``--trust-run-dir``: the reading verbs' way to accept, knowingly, a run directory that another user
owns or that group/others can write (``owner.check_run_dir``); the trainer's is ``train.trust_run_dir``."""
from __future__ import annotations

FLAG = "--trust-run-dir"


def add_trust_run_dir(parser) -> None:
    parser.add_argument(FLAG, action="store_true",
                        help="read the checkpoint even if its run directory is owned by another user or writable "
                             "by group/others (refused otherwise: someone else could have put it there)")


def check_source(path, args) -> None:
    """Refuse ``path`` (a run, its checkpoints or a tag) unless it is ours or ``--trust-run-dir`` was given."""
    from .owner import check_run_dir

    check_run_dir(path, trusted=bool(getattr(args, "trust_run_dir", False)), flag=FLAG)
