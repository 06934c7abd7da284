"""What ``megafixed submit`` checks before ``sbatch``: a job that would fail in the queue fails now.

* the pre-timeout signal must come before the time limit (``--signal-before`` < ``--time``), or
  the job checkpoints as it starts and requeues forever;
* an existing run directory must take the new config: the resume check the job would run at its
  start (``train.resume.check_resume`` against the latest checkpoint's run record), hours later;
* and what ``train --dry-run`` checks (layout, precision, the DeepSpeed config, data paths), which
  ``commands/submit.py`` runs itself.
"""
from __future__ import annotations

import re
from typing import Optional

from .world import LaunchError

# Slurm's --time forms: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
_DAYS = re.compile(r"^(\d+)-(\d{1,2})(?::(\d{1,2}))?(?::(\d{1,2}))?$")
_PLAIN = re.compile(r"^(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?$")


def time_limit_seconds(text: Optional[str]) -> Optional[int]:
    """Seconds of a Slurm ``--time`` value (None: unset or ``UNLIMITED``/``INFINITE``)."""
    if text is None or str(text).strip().upper() in ("UNLIMITED", "INFINITE", "-1"):
        return None
    t = str(text).strip()
    m = _DAYS.match(t)
    if m:
        d, h, mi, s = (int(x) if x else 0 for x in m.groups())
        return ((d * 24 + h) * 60 + mi) * 60 + s
    m = _PLAIN.match(t)
    if m:
        a, b, c = m.groups()
        if c is not None:  # HH:MM:SS
            return (int(a) * 60 + int(b)) * 60 + int(c)
        if b is not None:  # MM:SS
            return int(a) * 60 + int(b)
        return int(a) * 60  # MM
    raise LaunchError(f"--time {text!r} is not a Slurm time limit; use HH:MM:SS or D-HH:MM:SS")


def check_signal_lead(signal_before: int, time: Optional[str]) -> None:
    limit = time_limit_seconds(time)
    if limit is not None and signal_before >= limit:
        raise LaunchError(f"--signal-before {signal_before} is not below --time {time} ({limit} s): the job would "
                          f"be told to checkpoint and stop as soon as it starts, and requeue forever. Give "
                          f"--signal-before well below the limit (e.g. {max(limit // 10, 1)}), or a longer --time")
