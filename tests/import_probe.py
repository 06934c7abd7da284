"""What a megafixed command imports: ``python tests/import_probe.py OUT.json CMD [CMD ...]``.

Each CMD is one command line (a string, split on spaces) for ``megafixed.cli.main``. The probe imports
``megafixed.cli`` once, then runs every CMD in a forked child of its own (a fork is milliseconds; a new
interpreter is seconds), so each child's ``sys.modules`` is what that command added to the CLI and torch.
The child records ``sys.modules`` when the command leaves: by returning, by ``SystemExit`` (``--help``)
or by ``os._exit`` (``megafixed train``'s way out). OUT.json maps each CMD to
``{"code": exit code, "modules": [...], "env_added": [variables the command set]}``.
"""
from __future__ import annotations

import json
import os
import sys


def _child(cmd: str, write_fd: int) -> None:
    real_exit = os._exit

    before = set(os.environ)

    def record(code) -> None:
        os.write(write_fd, json.dumps({"code": int(code or 0), "modules": sorted(sys.modules),
                                       "env_added": sorted(set(os.environ) - before)}).encode())
        os.close(write_fd)

    def record_and_exit(code):
        record(code)
        real_exit(0)

    os._exit = record_and_exit
    from megafixed import cli

    try:
        code = cli.main(cmd.split())
    except SystemExit as exc:
        code = exc.code
    sys.stdout.flush()
    record_and_exit(code)


def main(out: str, cmds: list[str]) -> None:
    # The common start of every command, imported once: the CLI and torch (which the tests allow every
    # command; what they check is what comes on top of it).
    import torch  # noqa: F401

    import megafixed.cli  # noqa: F401

    results = {}
    for cmd in cmds:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)  # --help text and training lines are not the probe's output
            _child(cmd, write_fd)
        os.close(write_fd)
        chunks = []
        while chunk := os.read(read_fd, 1 << 16):
            chunks.append(chunk)
        os.close(read_fd)
        os.waitpid(pid, 0)
        results[cmd] = json.loads(b"".join(chunks) or b'{"code": -1, "modules": []}')
    with open(out, "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
