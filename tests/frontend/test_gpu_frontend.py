"""GPU checks of the frontend: the op list run eagerly on CUDA reproduces each model."""

import importlib.util
import sys

import pytest
import torch

from nimble import frontend
from nimble.ops import arguments
from nimble.runtime.placed import reference
from nimble.runtime.base.compare import compare
from nimble.ir import TensorSpec
from nimble.pipeline import rewrite, sample_inputs

from ..conftest import ROOT

pytestmark = pytest.mark.gpu


def test_sample_models_match_on_cuda(sample):
    name, path, shapes = sample
    lowered = rewrite(frontend.lower(frontend.load_module(path), [TensorSpec(tuple(s), "float32") for s in shapes], name))
    xs = sample_inputs([lowered.graph.values[i].spec for i in lowered.graph.inputs])
    with torch.no_grad():
        expected = arguments.flatten_result(lowered.module(*xs))
    got = reference.run(lowered.graph, lowered.weights, xs, "cuda")
    assert all(t.is_cuda for t in got)
    result = compare(got, expected, rtol=1e-2, atol=0)  # convolutions run in TF32 by default
    assert result.passed, result.describe()


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="needs torchvision")
@pytest.mark.parametrize("name", ["resnet50", "inception_v3", "googlenet", "mobilenet_v2",
                                  "efficientnet_b0", "squeezenet1_1", "densenet121"])
def test_torchvision_models_match_within_1e_3(name, tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from frontend_parity import check_model

    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        row = check_model(name, "cuda", tmp_path)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    assert row["passed"], row
