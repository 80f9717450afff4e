"""The package reads bottom-up: compat, comm, core, layer math and schedule cores, strategies, models, train.

Each folder of `jaxdist/` is one subpackage (comm, core, ddp, engine, tp, pipeline, models,
train); inside one, modules have their own layer (the tp plan sits above the tp layer math). A
module may import only from its own layer or the layers below it, and never a private
(underscore) module or name of another subpackage (`jaxdist.comm._backend` from outside
`jaxdist.comm`): what is shared is exposed.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "jaxdist"

# lower number = lower layer; a module imports only modules of its layer or below
LAYERS = {
    "jaxdist": 12,  # the package's __init__ imports what it exposes
    "jaxdist._xla_flags": 0,
    "jaxdist._moved": 0,
    "jaxdist.compat": 0,  # shims over JAX internals, below everything
    "jaxdist.comm": 1,
    "jaxdist.core": 2,
    "jaxdist.ddp.buckets": 2,
    "jaxdist.tp.layers": 2,
    "jaxdist.ddp.interleave": 3,
    "jaxdist.cp": 3,  # context parallelism: batch layout and attention over comm, below the engine
    "jaxdist.engine.prefetch": 3,
    "jaxdist.pipeline.schedule": 3,
    "jaxdist.tp.placement": 3,
    "jaxdist.tp.vocab_loss": 3,
    "jaxdist.tp.storage": 3,
    "jaxdist.tp": 4,
    "jaxdist.engine.residuals": 4,
    "jaxdist.ddp": 5,
    # the unit engine's parts, bottom-up: options and layout, the units and their communication,
    # the step and the canonical form, then the run that wires them (and FSDP, a configuration of it)
    "jaxdist.engine.options": 5,
    "jaxdist.engine.layout": 5,
    "jaxdist.engine.units": 6,
    "jaxdist.engine.apply": 6,
    "jaxdist.engine.unit_comm": 6,
    "jaxdist.engine.step": 7,
    "jaxdist.engine.canonical": 7,
    "jaxdist.engine": 8,
    "jaxdist.pipeline": 9,
    "jaxdist.models": 10,
    "jaxdist.train": 11,
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
    """The subpackage (folder) a module belongs to; `jaxdist` for the package's own top level."""
    parts = module.split(".")
    if len(parts) >= 2 and (ROOT / parts[1] / "__init__.py").is_file():
        return ".".join(parts[:2])
    return "jaxdist"


@pytest.mark.parametrize(("module", "path"), list(modules()), ids=[m for m, _ in modules()])
def test_imports_go_down_and_skip_other_packages_private_names(module, path):
    own = layer_of(module)
    assert own is not None, f"{module} has no layer in tests/package/test_layering.py: add it where it belongs"
    for target, name in imports(path):
        if not target.startswith("jaxdist"):
            continue
        full = f"{target}.{name}" if name and _is_module(f"{target}.{name}") else target
        their = layer_of(full)
        assert their is not None and their <= own, f"{module} (layer {own}) imports {full} (layer {their})"
        if package_of(module) == package_of(full):
            continue
        inner = full.split(".")[2:] if package_of(full) != "jaxdist" else full.split(".")[1:]
        assert not any(p.startswith("_") for p in inner), f"{module} imports {full}, private to {package_of(full)}"
        if name and name.startswith("_") and full == target:
            pytest.fail(f"{module} imports the private name {name} of {target}: expose it")


def test_every_folder_is_a_subpackage_with_a_layer():
    folders = [p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))]
    for folder in folders:
        if not list((ROOT / folder).glob("*.py")):
            continue  # data folders (configs, corpus)
        assert (ROOT / folder / "__init__.py").is_file(), f"jaxdist/{folder} has no __init__.py"
        assert layer_of(f"jaxdist.{folder}") is not None, f"jaxdist.{folder} has no layer here"


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
