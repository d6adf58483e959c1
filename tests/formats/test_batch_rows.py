"""A multi-batch artifact is one program at several batch sizes that computes each row from that
row alone (`nimble.ops.rows`): models that keep rows apart compile and load; an artifact whose
batch sizes mix, move or treat rows differently is refused at load, however it was made. The
forged artifacts here are put together as an attacker would: each batch size compiled alone, from
another model if need be, then written as one artifact (the writer checks nothing)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from typer.testing import CliRunner

from nimble.cli.main import app
from nimble.errors import ArtifactError, MismatchError, UnsupportedError
from nimble.formats import read_artifact, write_artifact
from nimble.formats.artifact import Artifact
from nimble.ops import batches, rows
from nimble.pipeline import compile_model
from nimble.specs import input_specs

from ..conftest import save_script


class KeepsRows(nn.Module):
    """Ops that move the rows between dimensions and back, and products that keep them apart."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))
        self.norm = nn.LayerNorm(6)

    def forward(self, x):  # x: [B, 4, 6]
        heads = x.reshape(-1, 2, 2, 6).permute(0, 2, 1, 3).reshape(-1, 2, 6)  # [B*2, 2, 6]
        att = F.softmax(heads @ heads.transpose(1, 2), -1) @ heads
        y = att.reshape(-1, 2, 2, 6).transpose(1, 2).flatten(1, 2)
        z = torch.einsum("bsd,de->bse", self.norm(y), self.w)
        return torch.cat([z, x.flip(1)], 2).sum(-1) + x.amax((1, 2)).unsqueeze(1)


class Rolls(nn.Module):
    def forward(self, x):
        return torch.roll(x, 1, 0) * 2


class Times(nn.Module):
    def __init__(self, k: float):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x * self.k


class Mean(nn.Module):
    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class Softmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x, 0)


class Gram(nn.Module):
    def forward(self, x):
        return x @ (x.t() @ x)


class Flat(nn.Module):
    def forward(self, x):
        return x.reshape(-1).roll(3).reshape(x.shape)


class Flip(nn.Module):
    def forward(self, x):
        return x.flip(0)


MIXERS = {  # a model that mixes or moves rows, and what the refusal says
    "roll": (Rolls(), "works along the dimension that holds the rows"),
    "mean": (Mean(), "reduces along the dimension that holds the rows"),
    "softmax": (Softmax(), "works along the dimension that holds the rows"),
    "gram": (Gram(), "contracts along the rows"),
    "flatten": (Flat(), "rolls the flattened tensor"),
    "flip": (Flip(), "works along the dimension that holds the rows"),
}


def forged(tmp_path, per_batch: dict[int, nn.Module], shape=(5,)) -> str:
    """One artifact whose batch sizes were each compiled alone from the given model."""
    compiled = {b: compile_model(save_script(tmp_path, m, f"m{b}"), input_specs(["x".join(map(str, (b, *shape)))]),
                                 device="cpu", check=False) for b, m in per_batch.items()}
    first, *rest = sorted(compiled)
    top = compiled[first].artifact()
    art = Artifact({**top.manifest, "batch_sizes": sorted(compiled)}, top.graph, top.schedule, top.memory,
                   top.weights, top.sample_inputs, top.sample_outputs,
                   {b: (compiled[b].graph, compiled[b].schedule, compiled[b].memory) for b in rest})
    path = tmp_path / "forged.nimble"
    write_artifact(path, art)
    return path


def test_a_model_that_keeps_rows_apart_compiles_and_loads_at_every_batch_size(tmp_path):
    model = KeepsRows().eval()
    c = compile_model(save_script(tmp_path, model, "keeps"), input_specs(["1x4x6"]), device="cpu",
                      batch_sizes=[1, 2, 4])
    path = tmp_path / "keeps.nimble"
    write_artifact(path, c.artifact())
    assert read_artifact(path).batch_sizes == [1, 2, 4]
    found = rows.batch_rows(c.others[-1].graph, 4)
    assert all(found[o] == rows.Rows(0) for o in c.others[-1].graph.outputs)
    assert any(r is not None and r.inner == 2 for r in found.values())  # the heads flattened into the batch


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_an_artifact_whose_graph_mixes_rows_is_refused_at_load(tmp_path, name):
    model, why = MIXERS[name]
    path = forged(tmp_path, {1: model, 2: model, 4: model})
    with pytest.raises(ArtifactError, match=why):
        read_artifact(path)
    result = CliRunner().invoke(app, ["run", str(path), "--device", "cpu"])
    assert result.exit_code == 1 and "Traceback" not in result.output and "batch 2" in result.output


def test_a_batch_size_that_computes_another_function_is_refused(tmp_path):
    # the case: batch 2 computes x*3 where batch 1 computes x*2; a check on repeated rows missed it
    path = forged(tmp_path, {1: Times(2.0), 2: Times(3.0)})
    with pytest.raises(ArtifactError, match="batch 2: op 0 .* is not batch 1's op with the batch substituted"):
        read_artifact(path)
    read_artifact(forged(tmp_path, {1: Times(2.0), 2: Times(2.0)}))  # the same function: accepted


def test_compile_refuses_a_model_that_moves_rows_even_on_repeated_samples(tmp_path):
    # the samples of every batch size now differ row by row, so a permutation shows
    with pytest.raises((MismatchError, UnsupportedError), match="rows"):
        compile_model(save_script(tmp_path, Rolls(), "rolls"), input_specs(["1x5"]), device="cpu", batch_sizes=[1, 2])
    result = CliRunner().invoke(app, ["compile", str(tmp_path / "rolls.pt"), "-s", "1x5", "--batch-sizes", "1,2",
                                      "--device", "cpu", "-o", str(tmp_path / "r.nimble")])
    assert result.exit_code != 0 and not (tmp_path / "r.nimble").exists()


def test_distinct_rows_differ_and_keep_the_sample_values():
    x = torch.tensor([[1, 2, 3]])
    got = batches.distinct_rows([x], 3)[0]
    assert got.tolist() == [[1, 2, 3], [3, 1, 2], [2, 3, 1]]


def test_verify_checks_every_batch_size_on_rows_that_differ(tmp_path, monkeypatch):
    import nimble

    good = nimble.load(forged(tmp_path, {1: Times(2.0), 2: Times(2.0), 4: Times(2.0)}), "cpu", verify=True)
    good.check_rows()
    # with the load-time proof switched off, the numeric check alone still sees batch 2's other function
    import nimble.formats.artifact

    monkeypatch.setattr(nimble.formats.artifact, "check_batches", lambda *a: None)
    bad = nimble.load(forged(tmp_path, {1: Times(2.0), 2: Times(3.0)}), "cpu")
    with pytest.raises(MismatchError, match="at batch 2, on rows that differ"):
        bad.check_rows()
