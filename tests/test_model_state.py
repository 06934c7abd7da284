"""The model keeps no state of its own at module level: no ``global`` statement and no module-level
container that code fills in (a process-wide cache of RoPE tables once broke a training step that ran
after an inference-mode eval in the same process). Read from the source with ``ast``."""
from __future__ import annotations

import ast
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "megafixed" / "model"
# filled by register() as the interfaces' modules are imported, then only read: a table, not a cache
REGISTRIES = {"interfaces.py": {"INTERFACES"}}


def module_state(source: str, registries: frozenset = frozenset()) -> list[str]:
    """What in ``source`` is module-level state: ``global`` statements, and module-level names bound to
    a container that some code mutates (a subscript store, ``.append``/``.update``/``.setdefault``/...)."""
    tree = ast.parse(source)
    found = [f"{n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    containers = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) else None
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and (isinstance(value, (ast.Dict, ast.List, ast.Set)) or (
                isinstance(value, ast.Call) and ast.unparse(value.func) in ("dict", "list", "set", "defaultdict"))):
            if target.id not in registries:
                containers[target.id] = node.lineno
    mutators = {"append", "extend", "update", "setdefault", "add", "pop", "clear", "insert", "remove"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)) \
                and isinstance(node.value, ast.Name) and node.value.id in containers:
            found.append(f"{node.lineno}: {node.value.id}[...] written")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in mutators \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in containers:
            found.append(f"{node.lineno}: {node.func.value.id}.{node.func.attr}(...)")
    return found


def test_the_model_package_has_no_module_level_state():
    offenders = [f"{p.relative_to(ROOT)}:{line}" for p in sorted(MODEL.rglob("*.py")) for line in
                 module_state(p.read_text(), frozenset(REGISTRIES.get(p.name, ())))]
    assert any(MODEL.rglob("*.py")), "the scan sees megafixed/model"
    assert not offenders, "module-level state in the model (keep it on the module, or pass it in):\n" + \
        "\n".join(offenders)


def test_the_scan_finds_a_cache_and_a_global():
    source = '''
_TABLES: dict = {}
_DEVICE = None
CONSTANT = {"a": 1}
def f(key):
    global _DEVICE
    _TABLES[key] = 1
    return CONSTANT["a"]
'''
    assert module_state(source) == ["6: global _DEVICE", "7: _TABLES[...] written"]


def test_initial_values_are_drawn_where_asked_and_on_the_cpu_by_default():
    from megafixed.config import load_config
    from megafixed.model.gpt import init_value

    cfg = load_config(None, ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                             "model.code_bits=8", "model.max_seq_len=32", "data.seq_len=32"]).model
    default = init_value(cfg, "blocks.0.attn.wq.weight", torch.Size([8, 8]), seed=3)
    cpu = init_value(cfg, "blocks.0.attn.wq.weight", torch.Size([8, 8]), seed=3, device=torch.device("cpu"))
    assert default.device.type == "cpu" and torch.equal(default, cpu)
