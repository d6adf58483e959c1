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
ORCHESTRATORS = {"nimble.pipeline", "nimble.multibatch", "nimble.api", "nimble.precision"}


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def test_only_the_pipeline_and_the_api_import_from_more_than_one_stage():
    """A stage may use shared leaves (ir, errors, ops, stages, ...) and at most one other stage;
    composing stages is the orchestrators' job (pipeline.py with multibatch.py, precision.py, api.py)."""
    for module, targets in MODULES.items():
        if module in ORCHESTRATORS:
            continue
        others = {stage_of(t) for t in targets} - {None, stage_of(module)}
        assert len(others) <= 1, f"{module} imports from the stages {sorted(others)}"
