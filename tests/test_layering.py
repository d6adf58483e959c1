"""Imports run downward only (DESIGN.md, "Layout"): frontend, passes and plan never import the
runtime, and plan never imports torch, not even through another nimble module. A plain AST walk
over the source, so it holds whatever is installed."""

from __future__ import annotations

import ast

import pytest

from .conftest import ROOT

CORE = ROOT / "core"


def module_name(path) -> str:
    parts = path.relative_to(CORE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("nimble", *parts))


def imports_of(path, source: str | None = None) -> set[str]:
    """Every module `path` imports, as absolute names (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # `from . import runtime`
    return found


MODULES = {module_name(p): imports_of(p) for p in CORE.rglob("*.py")}


def reaches(name: str) -> set[str]:
    """Every module `name` imports, directly or through nimble's own modules."""
    seen, todo = set(), [name]
    while todo:
        for target in MODULES.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def in_stage(stage: str) -> list[str]:
    return sorted(m for m in MODULES if m == f"nimble.{stage}" or m.startswith(f"nimble.{stage}."))


@pytest.mark.parametrize("stage", ["frontend", "passes", "plan", "ops"])
def test_stages_before_the_runtime_never_import_it(stage):
    assert in_stage(stage)
    for module in in_stage(stage):
        bad = sorted(t for t in reaches(module) if t == "nimble.runtime" or t.startswith("nimble.runtime."))
        assert not bad, f"{module} imports {bad}"


def test_plan_never_imports_torch():
    for module in in_stage("plan"):
        bad = sorted(t for t in reaches(module) if t == "torch" or t.startswith("torch."))
        assert not bad, f"{module} imports {bad}, directly or through nimble"


def test_the_walk_resolves_relative_and_lazy_imports():
    probe = CORE / "plan" / "probe.py"  # never written: the source is passed in
    source = "def f():\n    from ..runtime import streams\n    import torch.cuda\n"
    found = imports_of(probe, source)
    assert {"nimble.runtime", "nimble.runtime.streams", "torch.cuda"} <= found


STAGES = ("frontend", "passes", "plan", "runtime")
# the modules that state how the stages compose (the precision search runs the reduce_precision pass
# and the reference runtime's comparison in turn)
ORCHESTRATORS = {"nimble.pipeline", "nimble.multibatch", "nimble.api", "nimble.precision", "nimble.train"}


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def test_only_the_pipeline_and_the_api_import_from_more_than_one_stage():
    """A stage may use shared leaves (ir, errors, ops, stages, ...) and at most one other stage;
    composing stages is the orchestrators' job (pipeline.py with multibatch.py, precision.py, api.py,
    train.py)."""
    for module, targets in MODULES.items():
        if module in ORCHESTRATORS:
            continue
        others = {stage_of(t) for t in targets} - {None, stage_of(module)}
        assert len(others) <= 1, f"{module} imports from the stages {sorted(others)}"


# the runtime's floors, bottom up (core/runtime/__init__.py says what each holds); the modules at
# the runtime's top (loading, executable, batched, group, opening, training, trace, baselines)
# stand on all of them
RUNTIME_FLOORS = ("base", "kernels", "placed", "pairs", "assemble", "tune")


def runtime_floor(module: str) -> int | None:
    """The floor of a runtime module (its index in RUNTIME_FLOORS; the top is one past the last),
    or None for a module outside the runtime."""
    parts = module.split(".")
    if parts[:2] != ["nimble", "runtime"] or len(parts) < 3:
        return None
    return RUNTIME_FLOORS.index(parts[2]) if parts[2] in RUNTIME_FLOORS else len(RUNTIME_FLOORS)


def nimble_modules(targets) -> set[str]:
    """The nimble modules among import targets (`from . import x` names x's module; `from .m import
    name` names m)."""
    return {t for t in targets if t in MODULES}


def test_every_runtime_floor_exists_and_is_a_package():
    for floor in RUNTIME_FLOORS:
        assert (CORE / "runtime" / floor / "__init__.py").is_file(), floor


def test_each_runtime_floor_imports_only_from_its_own_and_the_floors_below():
    for module, targets in MODULES.items():
        mine = runtime_floor(module)
        if mine is None:
            continue
        for target in nimble_modules(targets):
            theirs = runtime_floor(target)
            assert theirs is None or theirs <= mine, \
                f"{module} (floor {mine}) imports {target} (floor {theirs}), a floor above it"


def circle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (module -> the modules it imports), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        for target in sorted(graph.get(module, ())):
            found = visit(target, path + [module])
            if found:
                return found
        done.add(module)
        return None

    for module in sorted(graph):
        found = visit(module, [])
        if found:
            return found
    return None


def test_no_nimble_module_takes_part_in_an_import_circle():
    """Lazy imports inside functions count: they are circles all the same. A package's face that
    re-exports its own modules is no circle through it."""
    packages = {m for m in MODULES if (CORE / m.replace("nimble.", "", 1).replace(".", "/") / "__init__.py").exists()
                or m == "nimble"}
    graph = {m: {t for t in nimble_modules(targets) - {m} if not (t in packages and m.startswith(t + "."))}
             for m, targets in MODULES.items()}
    circle = circle_in(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)
    assert circle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the search finds one


def test_the_walk_finds_a_floor_that_imports_upward():
    probe = CORE / "runtime" / "kernels" / "probe.py"  # never written: the source is passed in
    found = nimble_modules(imports_of(probe, "from ..placed import placement\n"))
    assert "nimble.runtime.placed.placement" in found
    assert runtime_floor("nimble.runtime.placed.placement") > runtime_floor("nimble.runtime.kernels.probe")
