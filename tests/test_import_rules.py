"""The package's import rules, read from the source with ``ast`` (nothing is imported, so this
runs in well under a second):

(a) only ``megafixed/engine/`` imports DeepSpeed -- at module level, inside a function, or by
    name through ``importlib.import_module``/``__import__``;
(b) the import graph of megafixed's modules has no cycle.

Which imports count for (b): module-level AND function-level ones. A function-level import is
still a dependency (the importing module cannot run without the other one); it is how we defer
a heavy library (torch, DeepSpeed) until it is needed, not a licence to let two modules lean on
each other. So the layering in docs/design.md holds for every import, and the stricter
module-level check (what Python itself would trip over at import time) is run on its own too,
with no exceptions at all. Imports under ``if TYPE_CHECKING:`` do not run, so the checks above run without
them and once more with them: an annotation import is a dependency a reader follows, and must point down the
layers like any other (``test_no_import_cycle_counting_every_import``).
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megafixed"
ENGINE = PACKAGE / "engine"



def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package ``__init__``) for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _absolute(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@functools.lru_cache(maxsize=None)
def _tree(module: str) -> ast.Module:
    path = MODULES[module][0]
    return ast.parse(path.read_text(), filename=str(path))


@functools.lru_cache(maxsize=None)
def _imports(module: str, function_level: bool, annotations: bool = False) -> tuple[tuple[str, int], ...]:
    """(imported module name, line) of every import in ``module`` (inside functions too, if asked; under
    ``if TYPE_CHECKING:`` too, if ``annotations``)."""
    is_pkg = MODULES[module][1]
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and not annotations:
                continue
            if top or function_level:
                if isinstance(child, ast.Import):
                    found.extend((a.name, child.lineno) for a in child.names)
                elif isinstance(child, ast.ImportFrom):
                    target = _absolute(module, is_pkg, child)
                    for a in child.names:  # `from pkg import sub` imports the submodule pkg.sub
                        sub = f"{target}.{a.name}"
                        found.append((sub if sub in MODULES else target, child.lineno))
                elif isinstance(child, ast.Call) and child.args and isinstance(child.args[0], ast.Constant) \
                        and isinstance(child.args[0].value, str) \
                        and ast.unparse(child.func).split(".")[-1] in ("import_module", "__import__"):
                    found.append((child.args[0].value, child.lineno))
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(_tree(module), True)
    return tuple(found)


@functools.lru_cache(maxsize=None)
def _graph(function_level: bool, annotations: bool = False) -> dict[str, set[str]]:
    return {m: {t for t, _ in _imports(m, function_level, annotations) if t in MODULES and t != m} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[frozenset]:
    """The strongly connected components with more than one module (Tarjan), i.e. the cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def _is_deepspeed(name: str) -> bool:
    return name == "deepspeed" or name.startswith("deepspeed.")


def test_only_the_engine_package_imports_deepspeed():
    offenders = [f"{MODULES[m][0].relative_to(ROOT)}:{line} imports {name}"
                 for m in MODULES if not MODULES[m][0].is_relative_to(ENGINE)
                 for name, line in _imports(m, function_level=True) if _is_deepspeed(name)]
    assert not offenders, "DeepSpeed is imported outside megafixed/engine/:\n" + "\n".join(offenders)


def _is_megatron(name: str) -> bool:
    return name == "megatron" or name.startswith("megatron.")


def test_only_the_engine_package_imports_megatron():
    # megatron-core's TP layers, process groups and losses are the DeepSpeed engine's
    # (engine/deepspeed/megatron_tp.py imports them for tp_layers.py, groups.py, mpu.py); parallel/ keeps the
    # engine-neutral plan
    offenders = [f"{MODULES[m][0].relative_to(ROOT)}:{line} imports {name}"
                 for m in MODULES if not MODULES[m][0].is_relative_to(ENGINE)
                 for name, line in _imports(m, function_level=True) if _is_megatron(name)]
    assert not offenders, "megatron-core is imported outside megafixed/engine/:\n" + "\n".join(offenders)
    seen = {m for m in MODULES for name, _ in _imports(m, function_level=True) if _is_megatron(name)}
    assert "megafixed.engine.deepspeed.megatron_tp" in seen  # the scan sees megatron where it is imported


def test_the_engine_package_does_import_deepspeed():
    # the rule above must be able to fail: the scan sees DeepSpeed where it really is imported
    seen = {m for m in MODULES if MODULES[m][0].is_relative_to(ENGINE)
            for name, _ in _imports(m, function_level=True) if _is_deepspeed(name)}
    assert {"megafixed.engine.deepspeed.build", "megafixed.engine.deepspeed.async_save",
            "megafixed.engine.deepspeed.pipeline"} <= seen


def test_no_module_level_import_cycle_anywhere():
    cycles = _cycles(_graph(function_level=False))
    assert not cycles, "module-level import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_no_import_cycle_counting_function_level_imports():
    cycles = _cycles(_graph(function_level=True))
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_no_import_cycle_counting_every_import():
    # module-level, function-local and annotation-only (``if TYPE_CHECKING:``) imports alike: an annotation
    # import is still a dependency a reader follows, and a cycle there is what lets real ones creep in.
    # ``import a.b.c`` is an edge to a.b.c; ``from x import y`` to x.y when that is a module, else to x.
    # No exception for a package ``__init__`` importing its own submodules: none of ours closes a cycle
    # (a submodule that imports its package's ``__init__`` back would, and is refused like any other).
    graph = _graph(function_level=True, annotations=True)
    assert "megafixed.config" in graph["megafixed.engine.protocols"]  # the scan sees an annotation import
    cycles = _cycles(graph)
    assert not cycles, "import cycles (every import counted): " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_the_annotation_scan_sees_type_checking_imports():
    # the rule above must be able to fail: an annotation-only import is an edge there and nowhere else
    assert "megafixed.config" not in _graph(function_level=True)["megafixed.engine.protocols"]
    assert "megafixed.config" in _graph(function_level=True, annotations=True)["megafixed.engine.protocols"]


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [frozenset({"a", "b", "c"})]


NATIVE = ENGINE / "native"


def _is_deepspeed_or_megatron(name: str) -> bool:
    top = name.split(".")[0]
    return top in ("deepspeed", "megatron") or name.startswith("megafixed.engine.deepspeed")


def test_the_torch_engine_imports_neither_deepspeed_nor_megatron():
    # train.engine=torch is a torch-only stack (tests/test_native_engine.py also checks a real build's
    # sys.modules); its modules must not reach DeepSpeed, megatron-core or the DeepSpeed engine directly
    native = [m for m in MODULES if MODULES[m][0].is_relative_to(NATIVE)]
    assert "megafixed.engine.native.build" in native  # the scan sees the package
    offenders = [f"{MODULES[m][0].relative_to(ROOT)}:{line} imports {name}" for m in native
                 for name, line in _imports(m, function_level=True) if _is_deepspeed_or_megatron(name)]
    assert not offenders, "the torch engine imports DeepSpeed/megatron:\n" + "\n".join(offenders)


# ------------------------------------------------------------------ (c) no engine's name outside it
ENGINE_NAMES = ("deepspeed", "torch")  # the built-in engines' train.engine values
REGISTRY = PACKAGE / "engines.py"
ENGINE_PACKAGES = (ENGINE / "deepspeed", ENGINE / "native")


def _engine_name_tests(tree: ast.AST) -> list[int]:
    """Lines that compare an engine field (anything spelt ``...engine...``) with an engine's name."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        def is_name(o) -> bool:  # "torch", or a tuple/list/set of names
            items = o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [o]
            return any(isinstance(c, ast.Constant) and c.value in ENGINE_NAMES for c in items)

        names = [o for o in operands if is_name(o)]
        fields = [o for o in operands if not is_name(o) and "engine" in ast.unparse(o).lower()]
        if names and fields:
            lines.append(node.lineno)
    return lines


def test_no_engine_name_is_tested_outside_its_package_and_the_registry():
    offenders = [f"{path.relative_to(ROOT)}:{line}" for m, (path, _) in MODULES.items()
                 if path != REGISTRY
                 and not any(path.is_relative_to(p) for p in ENGINE_PACKAGES)
                 for line in _engine_name_tests(_tree(m))]
    assert not offenders, ("an engine's name is compared outside its package (ask megafixed.engines: "
                           "kind_of(plan), its hooks):\n" + "\n".join(offenders))


def test_the_engine_name_scan_finds_a_name_test():
    # the rule above must be able to fail
    assert _engine_name_tests(ast.parse('if plan.engine == "torch":\n    pass')) == [1]
    assert _engine_name_tests(ast.parse('x = getattr(p, "engine", "deepspeed") != "torch"')) == [1]
    assert _engine_name_tests(ast.parse('if dtype == "torch": pass')) == []
    assert _engine_name_tests(ast.parse('s = lay.dp_shard if lay.engine == "torch" else max(lay.zero, 1)')) == [1]
    assert _engine_name_tests(ast.parse('if cfg.train.engine in ("deepspeed", "x"): pass')) == [1]


# ------------------------------------------------------------------ (d) kernels/ (megafixed.kernels)
KERNELS = ROOT / "kernels"


def test_kernels_import_neither_deepspeed_nor_megatron():
    offenders = []
    for path in sorted(KERNELS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                          if n.split(".")[0] in ("deepspeed", "megatron")]
    assert any(KERNELS.rglob("*.py")), "the scan sees kernels/"
    assert not offenders, "kernels/ imports an engine library:\n" + "\n".join(offenders)


# ------------------------------------------------------------------ (a) packages depend one way
def _unit(module: str) -> str:
    """A module's layer: its subpackage of megafixed (``megafixed.engine.native.build`` -> engine), or
    the top-level module itself (``megafixed.run_plan`` -> run_plan; ``megafixed.engines`` -> engines)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _two_way_pairs(graph: dict[str, set[str]]) -> list[str]:
    edges: dict[tuple, tuple] = {}
    for m, targets in graph.items():
        for t in targets:
            if _unit(m) != _unit(t):
                edges.setdefault((_unit(m), _unit(t)), (m, t))
    return [f"{a} <-> {b} ({' imports '.join(edges[a, b])}; {' imports '.join(edges[b, a])})"
            for a, b in sorted(edges) if a < b and (b, a) in edges]


@pytest.mark.parametrize("annotations", [False, True], ids=["running-imports", "with-annotation-imports"])
def test_no_two_packages_import_each_other_counting_function_level_imports(annotations):
    pairs = _two_way_pairs(_graph(function_level=True, annotations=annotations))
    assert not pairs, "packages importing each other (make one sit beneath the other):\n" + "\n".join(pairs)


@pytest.mark.parametrize("annotations", [False, True], ids=["running-imports", "with-annotation-imports"])
def test_the_packages_form_layers_counting_function_level_imports(annotations):
    # stronger than pairs: no longer loop either (train -> parallel -> launch -> train was one); with
    # ``annotations``, an ``if TYPE_CHECKING:`` import must point down the layers too
    graph = _graph(function_level=True, annotations=annotations)
    units: dict[str, set[str]] = {}
    for m, targets in graph.items():
        units.setdefault(_unit(m), set()).update(_unit(t) for t in targets if _unit(t) != _unit(m))
    cycles = _cycles(units)
    assert not cycles, "package-level import cycles: " + "; ".join(" -> ".join(sorted(c)) for c in cycles)


def test_the_package_rule_finds_a_two_way_pair():
    graph = {"megafixed.config": {"megafixed.model.gpt"}, "megafixed.model.gpt": {"megafixed.config"},
             "megafixed.engine.build": {"megafixed.parallel.layout"}, "megafixed.parallel.layout": set()}
    assert _two_way_pairs(graph) == [
        "config <-> model (megafixed.config imports megafixed.model.gpt; megafixed.model.gpt imports megafixed.config)"]
