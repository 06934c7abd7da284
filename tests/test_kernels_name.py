"""`kernels/` never shadows the registry's `kernels` package (HF's hub kernels) from a checkout's root.

`python -m ...` run from the root puts it first on sys.path, where `kernels/` (our Triton kernels, installed
as `megafixed.kernels`) is a top-level package too. transformers >= 5.25 imports the registry's `kernels`
whenever it is installed, so `megafixed export hf` run that way would fail. Each check runs in a
fresh interpreter started in the root, as the README's commands are."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, *flags: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def _installed_kernels_file() -> str | None:
    """Where `import kernels` lands from outside the checkout: the registry's package, or None."""
    found = _python("import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else '')",
                    cwd=ROOT / "docs")
    assert found.returncode == 0, found.stderr
    return found.stdout.strip() or None


def test_import_kernels_from_the_root_gets_the_installed_package_or_none():
    installed = _installed_kernels_file()
    got = _python("import kernels; print(kernels.__file__)")
    if installed is None:
        assert got.returncode != 0 and "megafixed.kernels" in got.stderr, got.stderr[-2000:]
    else:
        assert got.returncode == 0, got.stderr[-2000:]
        assert Path(got.stdout.strip()) == Path(installed)
        assert ROOT not in Path(got.stdout.strip()).resolve().parents


def test_without_the_registry_package_the_root_import_fails_naming_ours():
    # -S: no site-packages, so no registry `kernels` (nor torch) can be found; ours must not stand in
    got = _python("import kernels", "-S")
    assert got.returncode == 1
    assert "ModuleNotFoundError: No module named 'kernels' (megafixed's Triton kernels import as " \
           "megafixed.kernels)" in got.stderr


def test_transformers_and_megafixed_kernels_both_import_from_the_root():
    got = _python("import transformers.integrations.hub_kernels\n"
                  "import megafixed.kernels as mk\n"
                  "from megafixed.kernels.token_codes import token_codes_reference\n"
                  "assert mk.token_codes.__module__ == 'megafixed.kernels.token_codes', mk.token_codes\n"
                  "print('ok')")
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr[-3000:]
