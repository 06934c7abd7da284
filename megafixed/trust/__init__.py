"""What megafixed does with files it did not write: the one place that decides.

* ``pickles``: the globals a checkpoint's pickles would import (a static read, nothing is
  unpickled), checked against allow-lists kept as data (``allowlists/*.json``, one per library and
  the version it was read from) before DeepSpeed or DCP unpickle anything; and ``load_weights``,
  our own ``torch.load`` with ``weights_only=True`` and exactly those globals allowed.
* ``owner``: ssh's rule for a run directory: owned by someone else or writable by group/others is
  refused before anything in it is read, unless trusted knowingly (``train.trust_run_dir``,
  ``--trust-run-dir``).
* ``flag``: ``--trust-run-dir`` for the reading verbs.

Names staying inside their directory are checked where they are read: ``run.run_dir.latest_problem``
(``latest``) and ``run.manifest.inside`` (manifest entries).

Imports nothing heavy at import time (torch only inside ``load_weights``). See docs/security.md.
"""
from .errors import UntrustedCheckpoint, UntrustedRunDirectory  # noqa: F401
