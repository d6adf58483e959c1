from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_models"
sys.path.insert(0, str(ROOT))  # for sample_models.build

from sample_models.build import MODELS  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=sorted(MODELS))
def sample(request):
    """(name, path, input shapes) of each bundled sample model."""
    name = request.param
    return name, SAMPLES / f"{name}.pt", MODELS[name][1]


@pytest.fixture(scope="session")
def sample_artifacts(tmp_path_factory):
    """Every sample model compiled once (auto streams, checked on the CPU): name -> .nimble path."""
    from nimble.formats import write_artifact
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs

    folder = tmp_path_factory.mktemp("artifacts")
    out = {}
    for name, (_, shapes, _) in MODELS.items():
        compiled = compile_model(SAMPLES / f"{name}.pt", input_specs(["x".join(map(str, s)) for s in shapes]),
                                 device="cpu")
        write_artifact(folder / f"{name}.nimble", compiled.artifact())
        out[name] = folder / f"{name}.nimble"
    return out


def save_script(tmp_path: Path, module: torch.nn.Module, name: str) -> Path:
    """Script `module` and save it as TorchScript under tmp_path."""
    path = tmp_path / f"{name}.pt"
    torch.jit.save(torch.jit.script(module), str(path))
    return path


@pytest.fixture
def use_settings():
    """`use_settings(gemm_kernel=False, ...)`: those runtime settings (`runtime/base/settings.py`)
    current for the rest of the test, on top of what is current; the test's end restores them."""
    import dataclasses

    from nimble.runtime.base import settings

    tokens = []

    def use(**changes):
        tokens.append(settings._current.set(dataclasses.replace(settings.current(), **changes)))

    yield use
    for token in reversed(tokens):
        settings._current.reset(token)
