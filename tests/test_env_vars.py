"""``MEGAFIXED_*`` variables are read in one module, ``megafixed/env.py``, whose table lists each.

Read from the source with ``ast`` (nothing imported). A read is ``env.get(NAME)``, ``os.getenv(NAME)``,
``environ[NAME]``, ``NAME in environ``, ``.pop``/``.setdefault``, or a helper handed an environment and
a NAME (``_int(env, NAME)``) -- where NAME is a ``MEGAFIXED_*`` literal or a constant holding one (its
own module's, or one imported by name). Writing one for a child process (``{**os.environ, NAME: v}``,
``os.environ[NAME] = v``, the job script's ``export``) is not a read.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from megafixed import env as env_vars

ROOT = Path(__file__).resolve().parents[1]
ENV_MODULE = ROOT / "megafixed" / "env.py"
SOURCES = sorted([*(ROOT / "megafixed").rglob("*.py"), *(ROOT / "kernels").rglob("*.py"),
                  *(ROOT / "tools").rglob("*.py")])
JOB_SCRIPT = ROOT / "megafixed" / "launch" / "templates" / "job.sbatch"

def _is_ours(value) -> bool:
    return isinstance(value, str) and value.startswith("MEGAFIXED_")


def _module_constants(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and _is_ours(node.value.value):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _module_file(current: Path, node: ast.ImportFrom) -> Path | None:
    if node.level:
        base = current.parent
        for _ in range(node.level - 1):
            base = base.parent
        parts = node.module.split(".") if node.module else []
    else:
        parts = (node.module or "").split(".")
        if parts[0] != "megafixed":
            return None
        base, parts = ROOT / "megafixed", parts[1:]
        if parts[:1] == ["kernels"]:
            base, parts = ROOT / "kernels", parts[1:]
    path = base.joinpath(*parts)
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"


def _names(path: Path, tree: ast.Module) -> dict[str, str]:
    """Name -> the MEGAFIXED_* value it holds in this module: its own constants and those imported by name."""
    names = _module_constants(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _module_file(path, node)
            if source and source.exists():
                theirs = _module_constants(ast.parse(source.read_text()))
                names.update({a.asname or a.name: theirs[a.name] for a in node.names if a.name in theirs})
    return names


def _every_module_constant() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in SOURCES:
        for k, v in _module_constants(ast.parse(path.read_text())).items():
            out.setdefault(k, set()).add(v)
    return out


def _is_environment(node: ast.AST) -> bool:
    """``os.environ``, ``env``, ``self.child_env``: a name that says it is an environment."""
    return isinstance(node, (ast.Name, ast.Attribute)) and "env" in ast.unparse(node).split(".")[-1].lower()


def reads(source: str, names: dict[str, str], attributes: dict[str, set[str]]) -> list[tuple[int, str]]:
    """(line, variable) of every read of a MEGAFIXED_* variable in ``source``."""
    def ours(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and _is_ours(node.value):
            return {node.value}
        if isinstance(node, ast.Name) and node.id in names:
            return {names[node.id]}
        if isinstance(node, ast.Attribute) and node.attr in attributes:
            return attributes[node.attr]
        return set()

    found = []
    for node in ast.walk(ast.parse(source)):
        hit: set[str] = set()
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault", "__getitem__") \
                    and _is_environment(func.value) and node.args:
                hit = ours(node.args[0])
            elif ast.unparse(func).split(".")[-1] == "getenv" and node.args:
                hit = ours(node.args[0])
            elif any(_is_environment(a) for a in node.args):  # a helper handed the environment and a name
                hit = set().union(*(ours(a) for a in node.args))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environment(node.value):
            hit = ours(node.slice)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_is_environment(c) for c in node.comparators):
            hit = ours(node.left)
        found += [(node.lineno, name) for name in sorted(hit)]
    return found


def _reads_outside_the_env_module() -> list[str]:
    attributes = _every_module_constant()
    out = []
    for path in SOURCES:
        if path == ENV_MODULE:
            continue
        text = path.read_text()
        for line, name in reads(text, _names(path, ast.parse(text)), attributes):
            out.append(f"{path.relative_to(ROOT)}:{line} reads {name}")
    return out


def test_no_module_but_megafixed_env_reads_a_megafixed_variable():
    offenders = _reads_outside_the_env_module()
    assert not offenders, "read MEGAFIXED_* through megafixed.env (and list it in its VARIABLES):\n" + \
        "\n".join(offenders)


def test_the_scan_finds_each_kind_of_read_and_no_write():
    source = '''
import os
from megafixed.pause import ENV
OWN = "MEGAFIXED_OWN"
a = os.environ.get("MEGAFIXED_A")
b = os.getenv(OWN)
c = env["MEGAFIXED_C"]
d = "MEGAFIXED_D" in os.environ
e = _int(env, "MEGAFIXED_E")
f = os.environ.get(ENV)
g = os.environ.get(versions.ALLOW_ENV)
os.environ["MEGAFIXED_W"] = "1"
child = {**os.environ, "MEGAFIXED_X": "1"}
extra = {"MEGAFIXED_Y": 1}; extra.get("MEGAFIXED_Y")
os.environ.get("OMP_NUM_THREADS")
'''
    names = {"OWN": "MEGAFIXED_OWN", "ENV": "MEGAFIXED_PAUSE"}
    found = reads(source, names, {"ALLOW_ENV": {"MEGAFIXED_ALLOW_UNTESTED"}})
    assert sorted(n for _, n in found) == sorted(["MEGAFIXED_A", "MEGAFIXED_OWN", "MEGAFIXED_C", "MEGAFIXED_D",
                                                  "MEGAFIXED_E", "MEGAFIXED_PAUSE", "MEGAFIXED_ALLOW_UNTESTED"])


def test_the_scan_sees_a_read_in_the_package():
    path = ROOT / "megafixed" / "pause.py"
    text = path.read_text().replace("raw = env_vars.pause(env)", "raw = os.environ.get(ENV, '')")
    assert reads(text, _names(path, ast.parse(text)), {}) == [(_line_of(text, "os.environ.get(ENV"),
                                                              "MEGAFIXED_PAUSE")]


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def _read_in_env_module() -> set[str]:
    tree = ast.parse(ENV_MODULE.read_text())
    return {node.args[0].value for node in ast.walk(tree) if isinstance(node, ast.Call)
            and ast.unparse(node.func) == "_get" and isinstance(node.args[0], ast.Constant)}


def test_the_table_lists_every_variable_read_and_no_other():
    read = _read_in_env_module()
    assert read, "the scan sees megafixed/env.py's readers"
    assert read == set(env_vars.VARIABLES), (f"read but not in VARIABLES: {sorted(read - set(env_vars.VARIABLES))}; "
                                             f"in VARIABLES but never read: {sorted(set(env_vars.VARIABLES) - read)}")
    assert all(len(what) > 20 for what in env_vars.VARIABLES.values()), "each row says what its variable does"


def test_every_megafixed_name_in_the_code_is_in_the_table():
    # a name spelled anywhere (read, or set for a child process) is one the table must explain
    tables = set(env_vars.VARIABLES) | set(env_vars.JOB_SCRIPT_VARIABLES)
    unknown = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                unknown += [f"{path.relative_to(ROOT)}:{node.lineno} {name}"
                            for name in re.findall(r"MEGAFIXED_[A-Z_]+[A-Z]", node.value) if name not in tables]
    assert not unknown, "MEGAFIXED_* names missing from megafixed.env's tables:\n" + "\n".join(unknown)


def test_the_job_script_reads_only_its_own_variables_and_exports_the_others():
    text = JOB_SCRIPT.read_text()
    read_by_the_script = set(re.findall(r"\$\{(MEGAFIXED_[A-Z_]+):-", text))
    assert set(env_vars.JOB_SCRIPT_VARIABLES) <= read_by_the_script
    # MEGAFIXED_RDZV_TIMEOUT is passed on with a default, for the Python reader
    assert read_by_the_script - set(env_vars.JOB_SCRIPT_VARIABLES) <= set(env_vars.VARIABLES)
    exported = set(re.findall(r"^export (MEGAFIXED_[A-Z_]+)=", text, flags=re.M))
    assert exported and exported <= set(env_vars.VARIABLES)


def test_the_readers_take_a_mapping():
    assert env_vars.traceback_wanted({"MEGAFIXED_TRACEBACK": " 1 "})
    assert not env_vars.traceback_wanted({"MEGAFIXED_TRACEBACK": "no"})
    assert env_vars.allow_untested({"MEGAFIXED_ALLOW_UNTESTED": "1"}) and not env_vars.allow_untested({})
    assert env_vars.peak_tflops({"MEGAFIXED_PEAK_TFLOPS": "989"}) == 989.0 and env_vars.peak_tflops({}) is None
    assert env_vars.force_triton({"MEGAFIXED_FORCE_TRITON": "1"}) and not env_vars.force_triton({})
    assert env_vars.pause({"MEGAFIXED_PAUSE": " train.step@3 "}) == "train.step@3"
    assert env_vars.cache_dir({}) == "" and env_vars.rdzv_timeout({"MEGAFIXED_RDZV_TIMEOUT": "5"}) == "5"
