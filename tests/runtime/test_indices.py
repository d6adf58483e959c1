"""Index values never reach a kernel out of range (`runtime/placed/indices.py`): token ids are checked on
the host with one clear error, constant indices at load, computed ones are clamped on CUDA; and
the warm-up runs on the stored sample inputs, never on uninitialised buffers."""

import numpy as np
import pytest
import torch
from torch import nn

import nimble
from nimble.errors import ArtifactError, MismatchError, ShapeError
from nimble.pipeline import compile_model
from nimble.runtime.executable import Executable
from nimble.runtime.placed.indices import plan_indices
from nimble.specs import input_specs

from ..conftest import SAMPLES, save_script
from ..cli.test_cli import invoke, one_line_error


@pytest.fixture(scope="module")
def bert():
    return compile_model(SAMPLES / "bert.pt", input_specs(["1x16", "1x16"], ["int64"]), device="cpu")


def test_token_ids_are_checked_on_the_host_before_a_call(bert):
    plan = plan_indices(bert.graph)
    assert 0 in plan.inputs  # the ids feed the embedding
    exe = Executable(bert.artifact(), "cpu")
    ids, mask = bert.sample_inputs
    exe(ids, mask)
    for bad in (ids + 10**6, ids - 5):
        with pytest.raises(ShapeError, match=r"input '.*' holds the index -?\d+, but op \d+ \(aten::embedding"):
            exe(bad, mask)


def test_run_names_an_out_of_range_id_in_one_line(bert, tmp_path):
    path = tmp_path / "bert.nimble"
    from nimble.formats import write_artifact

    write_artifact(path, bert.artifact())
    ids, mask = (t.numpy() for t in bert.sample_inputs)
    np.save(tmp_path / "ids.npy", ids + 50_000)
    np.save(tmp_path / "mask.npy", mask)
    line = one_line_error(invoke("run", path, "--input", f"input_ids={tmp_path / 'ids.npy'}",
                                 "--input", f"attention_mask={tmp_path / 'mask.npy'}", "--device", "cpu"), 1)
    assert "holds the index" in line and "aten::embedding" in line


class _Picks(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("idx", torch.tensor([0, 2]))

    def forward(self, x):
        return x.index_select(1, self.idx) * 2


def test_a_constant_index_out_of_range_is_refused_at_load(tmp_path):
    c = compile_model(save_script(tmp_path, _Picks(), "picks"), input_specs(["2x3"]), device="cpu")
    art = c.artifact()
    art.weights = dict(art.weights)
    (name,) = [n for n, t in art.weights.items() if t.dtype == torch.int64]
    assert 1 not in plan_indices(c.graph).inputs and plan_indices(c.graph).weights
    Executable(art, "cpu")
    art.weights[name] = torch.tensor([0, 99])  # a crafted artifact: same shape and dtype
    with pytest.raises(ArtifactError, match=f"weight '{name}' holds the index 99"):
        Executable(art, "cpu")


class _Gathers(nn.Module):
    def forward(self, x):
        return x.gather(1, x.argmax(1, keepdim=True)) + 1


def test_computed_indices_are_clamped_not_trusted(tmp_path):
    c = compile_model(save_script(tmp_path, _Gathers(), "gathers"), input_specs(["2x5"]), device="cpu")
    plan = plan_indices(c.graph)
    (clamps,) = plan.clamps.values()
    assert clamps == [(2, None, 0, 4)] and not plan.inputs and not plan.weights


def test_the_buffers_hold_the_sample_inputs_before_any_op_runs(bert):
    exe = Executable(bert.artifact(), "cpu")
    for buf, x in zip(exe.input_buffers, bert.sample_inputs):
        assert torch.equal(buf, x)


def test_a_stored_sample_input_out_of_range_is_an_artifact_error(bert):
    art = bert.artifact()
    art.sample_inputs = [art.sample_inputs[0] + 10**6, *art.sample_inputs[1:]]
    with pytest.raises(ArtifactError, match="stored sample input does not fit"):
        Executable(art, "cpu")


def test_load_can_verify_itself_against_the_stored_outputs(bert, tmp_path):
    from nimble.formats import write_artifact

    path = tmp_path / "bert.nimble"
    write_artifact(path, bert.artifact())
    assert nimble.load(path, device="cpu", verify=True) is not None
    art = bert.artifact()
    art.sample_outputs = [art.sample_outputs[0] + 1, *art.sample_outputs[1:]]
    with pytest.raises(MismatchError, match="does not reproduce the stored outputs"):
        Executable(art, "cpu").verify()
