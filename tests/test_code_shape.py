"""The project guide's shape rule: no function over 80 lines in ``megafixed/`` or ``kernels/``
(read with ``ast``, every module, nothing exempt). A failure names each one: file:line, name, length."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("megafixed", "kernels")
MAX_LINES = 80


def long_functions(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``file:line name (N lines)`` for every function or method in ``root``'s modules longer than
    ``limit`` lines, from its ``def`` line to its last (decorators not counted, nested ones too)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_the_rule_sees_a_long_function(tmp_path):
    # the checker itself must be able to fail: an 81-line method is caught, an 80-line function is not
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    def body(indent: str, lines: int) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(lines))

    (pkg / "m.py").write_text(f"def ok():\n{body('    ', 79)}\n\nclass C:\n    def long(self):\n{body('        ', 80)}")
    assert long_functions(pkg) == ["pkg/m.py:84 long (81 lines)"]


def test_no_function_over_80_lines():
    roots = [ROOT / name for name in PACKAGES]
    assert all(r.is_dir() for r in roots), roots
    found = [line for r in roots for line in long_functions(r)]
    assert not found, f"functions over {MAX_LINES} lines (split them into named steps):\n" + "\n".join(found)
