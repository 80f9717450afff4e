"""The package reads top-down: comm -> schedule cores -> unit/state shell -> strategies -> train.

A module may import only from its own layer or the layers below it, and never a
private (underscore) name of another subpackage (`jaxdist.comm._backend` from
outside `jaxdist.comm`) or module: what is shared is exposed. The library's own
top-level internals (`jaxdist._native`, `jaxdist._pipeline`, ...) serve every layer above them.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "jaxdist"

# lower number = lower layer; a module imports only modules of its layer or below
LAYERS = {
    "jaxdist": 7,  # the package's __init__ imports what it exposes
    "jaxdist._native": 0,
    "jaxdist._compat": 0,
    "jaxdist._xla_flags": 0,
    "jaxdist.comm": 1,
    "jaxdist.buckets": 2,
    "jaxdist.tp": 2,
    "jaxdist._pipeline": 3,
    "jaxdist._interleave": 3,
    "jaxdist.pipeline_schedule": 3,
    "jaxdist._step": 4,
    "jaxdist.model_state": 4,
    "jaxdist.canonical": 4,
    "jaxdist.contract": 4,
    "jaxdist.per_leaf": 4,
    "jaxdist.tp_plan": 4,
    "jaxdist._tp_grads": 4,
    "jaxdist._residuals": 4,
    "jaxdist.ddp": 5,
    "jaxdist.fsdp": 5,
    "jaxdist.engine": 5,
    "jaxdist.pipeline": 5,
    "jaxdist.train": 6,
}


def layer_of(module: str) -> int | None:
    best = None
    for name, layer in LAYERS.items():
        if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[0])):
            best = (name, layer)
    return None if best is None else best[1]


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        yield ".".join(parts), path


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT.parent / rel).with_suffix(".py").is_file() or (ROOT.parent / rel / "__init__.py").is_file()


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or module in ("jaxdist.comm", "jaxdist.train") else "jaxdist"


@pytest.mark.parametrize(("module", "path"), list(modules()), ids=[m for m, _ in modules()])
def test_imports_go_down_and_skip_other_packages_private_names(module, path):
    own = layer_of(module)
    assert own is not None, f"{module} has no layer in tests/test_layering.py: add it where it belongs"
    for target, name in imports(path):
        if not target.startswith("jaxdist"):
            continue
        full = f"{target}.{name}" if name and _is_module(f"{target}.{name}") else target
        their = layer_of(full)
        assert their is not None and their <= own, f"{module} (layer {own}) imports {full} (layer {their})"
        if package_of(module) != package_of(target):
            private = [p for p in target.split(".")[1:] if p.startswith("_")] if target.count(".") > 1 else []
            assert not private, f"{module} imports {target}, private to {package_of(target)}: expose what it needs"
        owner = package_of(f"{target}.{name}")
        # jaxdist's own top-level internals (_native, _pipeline, ...) serve the whole library
        if name and name.startswith("_") and owner != "jaxdist" and owner != package_of(module):
            pytest.fail(f"{module} imports the private name {name} of {target}: expose it")


def import_graph() -> dict[str, set[str]]:
    """jaxdist module -> the jaxdist modules it imports by name (also inside functions)."""
    graph = {}
    for module, path in modules():
        targets = set()
        for target, name in imports(path):
            if target.startswith("jaxdist"):
                targets.add(f"{target}.{name}" if name and _is_module(f"{target}.{name}") else target)
        graph[module] = targets - {module}
    return graph


def test_no_module_imports_itself_through_others():
    graph, state, cycles = import_graph(), {}, []

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, f"import cycles: {cycles}"
