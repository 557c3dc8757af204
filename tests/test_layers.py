"""The import layers of docs/architecture.md: every module imports only from layers below
its own (or from its own layer), read from the source with `ast`, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxserve", "pallas_kernels", "sharding", "server", "benchmarks")

# (rank, layer, module prefixes); the longest matching prefix names a module's layer. A
# module may import its own layer and any layer of a lower rank, never one of its own
# rank or above.
LAYERS = [
    (0, "placement", ("sharding", "sharding.strategies", "sharding.mesh", "sharding.rules",
                      "sharding.multihost")),
    (0, "kernels", ("pallas_kernels",)),
    (1, "config", ("jaxserve.config", "jaxserve.sampling_params", "jaxserve.pooling_params",
                   "jaxserve.outputs")),
    (2, "models", ("jaxserve.models",)),
    (3, "loading", ("jaxserve.loading", "jaxserve.demo")),
    (4, "engine", ("jaxserve", "jaxserve.engine", "jaxserve.llm")),
    (5, "servers", ("server",)),
    (5, "tools", ("sharding.planner", "sharding.plan_report")),
    (6, "cli", ("jaxserve.cli", "jaxserve.__main__")),
    (6, "benchmarks", ("benchmarks",)),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def layer_of(module: str) -> tuple[int, str] | None:
    """(rank, layer) of one of our modules; None for third-party ones."""
    best = None
    for rank, layer, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                    best is None or len(prefix) > best[0]):
                best = (len(prefix), rank, layer)
    return best and best[1:]


def imports(path: Path, module: str) -> set[str]:
    """Every module `path` imports, anywhere in it; benchmark scripts import each other by
    bare name (their folder is on sys.path when they run)."""
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".")[: len(module.split(".")) - node.level + (
                    path.name == "__init__.py")]
                base = ".".join(package + ([base] if base else []))
            # `from sharding import planner` imports sharding.planner (a tool), not just
            # the package: each name is taken as base.name, whose layer falls back to
            # base's when it is not a module.
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if module.startswith("benchmarks.") and name.split(".")[0] in scripts:
                name = "benchmarks." + name
            found.add(name)
    return found


def violations() -> list[str]:
    found = []
    for module, path in modules().items():
        rank, layer = layer_of(module)
        for name in imports(path, module):
            target = layer_of(name)
            if target is None or target[1] == layer:
                continue
            if target[0] >= rank:
                found.append(f"{module} ({layer}) imports {name} ({target[1]})")
    return sorted(found)


def test_every_module_has_a_layer():
    assert [m for m in modules() if layer_of(m) is None] == []


def test_no_module_imports_a_layer_above_its_own():
    assert violations() == []


def test_the_checker_sees_a_lazy_import_inside_a_function(tmp_path, monkeypatch):
    """A lower layer importing a higher one inside a function (as the old planner-helpers
    and CLI did) is caught: the check reads every import statement, not just the top."""
    fake = tmp_path / "sharding" / "rules.py"
    fake.parent.mkdir()
    fake.write_text("def f():\n    from jaxserve.engine.engine import Engine\n    return Engine\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    monkeypatch.setattr(f"{__name__}.PACKAGES", ("sharding",))
    (tmp_path / "benchmarks").mkdir()
    assert violations() == [
        "sharding.rules (placement) imports jaxserve.engine.engine.Engine (engine)"]


def speculative_imports_of_the_engine() -> list[str]:
    """Inside the engine layer, speculative/ sits below engine.py: the engine calls the
    Speculator interface, never the other way round. Every import of engine.py (lazy
    ones included) from the package."""
    package = ROOT / "jaxserve" / "engine" / "speculative"
    return sorted(f"{module} imports {name}" for module, path in modules().items()
                  if path.is_relative_to(package) for name in imports(path, module)
                  if name.startswith("jaxserve.engine.engine"))


def test_speculative_decoding_never_imports_the_engine():
    assert speculative_imports_of_the_engine() == []
    assert len(list((ROOT / "jaxserve/engine/speculative").glob("*.py"))) >= 8


def test_the_speculative_rule_sees_an_import_of_the_engine(tmp_path, monkeypatch):
    fake = tmp_path / "jaxserve" / "engine" / "speculative" / "proposers.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from jaxserve.engine.engine import InFlightStep\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert speculative_imports_of_the_engine() == [
        "jaxserve.engine.speculative.proposers imports jaxserve.engine.engine.InFlightStep"]


@pytest.mark.parametrize("module,layer", [
    ("sharding.rules", "placement"), ("sharding.planner", "tools"), ("jaxserve.cli", "cli"),
    ("jaxserve.engine.engine", "engine"), ("jaxserve.models.parallel", "models"),
    ("server.app", "servers"), ("pallas_kernels.tiling", "kernels"),
])
def test_layer_names(module, layer):
    assert layer_of(module)[1] == layer
