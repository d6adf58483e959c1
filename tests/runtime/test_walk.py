"""A prebuild's walk (`runtime/prebuild.py`) over claimed tensors (`base/claimed.py`): that it
goes where a load goes (streams that pair other ops, the references cuDNN graphs are timed
against, cuDNN's fused convolutions) and that it stays cheap (no torch._dynamo import)."""

from __future__ import annotations

import collections
import subprocess
import sys

import pytest
import torch

from nimble.formats import write_artifact
from nimble.pipeline import compile_model
from nimble.runtime import pairs, prebuild
from nimble.runtime.base import claimed as claims
from nimble.runtime.base.claimed import claimed
from nimble.runtime.kernels import aot, cudnn_graph
from nimble.specs import input_specs

from ..conftest import SAMPLES

H100 = aot.Target(90, 132)


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    compiled = compile_model(SAMPLES / "resnet.pt", input_specs(["1x3x32x32"]), device="cpu")
    path = tmp_path_factory.mktemp("walk") / "resnet.nimble"
    art = compiled.artifact()
    write_artifact(path, art)
    return art, path


@pytest.mark.parametrize("op", ["abs", "sub", "ne", "mul_broadcast", "add_scalar", "sigmoid", "lt_scalar"])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_elementwise_results_on_claimed_tensors_are_laid_out_as_torch_lays_them(op, layout):
    def run(x, c):
        return {"abs": lambda: x.abs(), "sub": lambda: x - x, "ne": lambda: x.ne(x), "mul_broadcast": lambda: x * c,
                "add_scalar": lambda: x + 2, "sigmoid": lambda: x.sigmoid(), "lt_scalar": lambda: x < 0.5}[op]()
    real = run(torch.randn(2, 4, 3, 5).contiguous(memory_format=layout), torch.randn(1, 4, 1, 1))
    with claims.walk([], torch.device("cuda", 0)):
        got = run(claimed((2, 4, 3, 5), torch.float32, layout), claimed((1, 4, 1, 1), torch.float32))
    assert isinstance(got, claims.Claimed)
    assert (got.shape, got.dtype, got.stride()) == (real.shape, real.dtype, real.stride())


def test_cudnn_fused_convolutions_have_results_on_claimed_tensors():
    """They have no meta kernel; a walk on a machine whose torch has cuDNN reaches them."""
    x = claimed((1, 8, 16, 16), torch.float32, torch.channels_last)
    w = claimed((4, 8, 3, 3), torch.float32, torch.channels_last)
    z = claimed((1, 4, 16, 16), torch.float32, torch.channels_last)
    relu = torch.ops.aten.cudnn_convolution_relu(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    add_relu = torch.ops.aten.cudnn_convolution_add_relu(x, w, z, 1.0, None, [1, 1], [1, 1], [1, 1], 1)
    for got in (relu, add_relu):
        assert isinstance(got, claims.Claimed) and tuple(got.shape) == (1, 4, 16, 16)
        assert got.is_contiguous(memory_format=torch.channels_last) and not got.is_contiguous()
    flat = torch.ops.aten.cudnn_convolution_relu(claimed((1, 8, 16, 16), torch.float32),
                                                 claimed((4, 8, 3, 3), torch.float32), None, [2, 2], [1, 1], [1, 1], 1)
    assert tuple(flat.shape) == (1, 4, 8, 8) and flat.is_contiguous()


def test_the_walk_runs_the_reference_cudnn_graphs_are_timed_against():
    """A load with cuDNN's frontend times each graph plan against nimble's own kernels (the
    reference); a walk has no plan but notes the reference's kernels, whether or not this
    machine has the frontend."""
    ran = []
    with claims.walk([], torch.device("cuda", 0)):
        out = claimed((1, 4, 8, 8), torch.float32)
        operands = (claimed((1, 8, 8, 8), torch.float32), claimed((4, 8, 1, 1), torch.float32), None)
        got = cudnn_graph.choose({}, (), operands, out, lambda: ran.append("reference"), cudnn_graph.Workspaces())
    assert got is None and ran == ["reference"]


def test_a_stream_candidate_that_pairs_other_ops_is_walked_too(resnet, monkeypatch):
    """Pairs are found per issue order and stream (two ops on different streams never pair):
    each candidate's pairs are walked, not only each layout's."""
    art = resnet[0]
    walks = []
    made = prebuild._Walk.__init__

    def counted(self, *args, **kwargs):
        walks.append(1)
        made(self, *args, **kwargs)
    monkeypatch.setattr(prebuild._Walk, "__init__", counted)
    plain = prebuild.walk(art, H100)
    plain_walks = len(walks)
    real = prebuild.issue_order

    def unpaired_when_serial(*args, **kwargs):  # as if one op paired only on the planned streams
        found = real(*args, **kwargs)
        if args[4].streams == "serial":
            found.pairs = pairs.Pairs()
        return found
    monkeypatch.setattr(prebuild, "issue_order", unpaired_when_serial)
    walks.clear()
    both = prebuild.walk(art, H100)
    assert len(walks) > plain_walks  # the serial candidate walked on its own
    # everything the paired walk found, and the unpaired ops' own kernels where they launch any
    # that nothing else launches (with CPU torch, its fused op's epilogue; with cuDNN, none)
    assert set(plain) <= set(both)
    if not torch.backends.cudnn.is_available():
        assert set(plain) < set(both)


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    compiled = compile_model(SAMPLES / "transformer.pt", input_specs(["1x64x128"]), device="cpu")
    path = tmp_path_factory.mktemp("walk") / "transformer.nimble"
    write_artifact(path, compiled.artifact())
    return compiled.artifact(), path


class _Windows(torch.nn.Module):
    """swin_t's layer norm over a permuted convolution's map, then a roll: PyTorch runs them, and
    their meta kernels are torch._refs that import torch._dynamo on their first call."""

    def __init__(self):
        super().__init__()
        self.norm, self.conv = torch.nn.LayerNorm(16), torch.nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        return torch.roll(self.norm(self.conv(x).permute(0, 2, 3, 1)), (1, 1), (1, 2)).permute(0, 3, 1, 2) + x


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    folder = tmp_path_factory.mktemp("walk")
    torch.jit.trace(_Windows().eval(), torch.randn(1, 16, 8, 8)).save(str(folder / "windows.pt"))
    compiled = compile_model(folder / "windows.pt", input_specs(["1x16x8x8"]), device="cpu")
    write_artifact(folder / "windows.nimble", compiled.artifact())
    return compiled.artifact(), folder / "windows.nimble"


@pytest.mark.parametrize("sample", ["resnet", "transformer", "windows"])
def test_a_walk_imports_no_dynamo(sample, request):
    """torch's meta kernels of elementwise ops are Python that imports torch._dynamo on first
    use (1.3 to 1.7 s): the walk of a load's critical path makes those results itself. PyTorch's
    attention, the reference generated attention is timed against, is not run on claimed tensors
    (its math path imported torch._dynamo: 3 s of BERT-base's walk on the CPU builder); the meta
    kernels that remain run beside a stand-in torch._dynamo (`shapes.without_dynamo_import`)."""
    path = request.getfixturevalue(sample)[1]
    code = ("import sys, torch\n"
            "from nimble.formats import read_artifact\n"
            "from nimble.runtime import prebuild\n"
            "from nimble.runtime.kernels import aot\n"
            f"found = prebuild.walk(read_artifact({str(path)!r}), aot.Target(90, 132))\n"
            "print(len(found), 'torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    count, dynamo = done.stdout.split()
    assert int(count) > 0 and dynamo == "False"


def test_a_product_with_the_op_after_it_is_walked_every_way_its_load_may_take():
    """A load times the float32 product's tiles (`gemm.TILES`) against PyTorch's product, and runs
    the elementwise op after it in the product's kernel, with the tile it keeps, or apart where
    PyTorch's product wins. In a walk every tile ties and PyTorch's never wins, so the walk
    defines that kernel with each tile and the op's own kernel too (before, only the first tile:
    the H200 took the other for BERT's and swin_t's products, or ran the op apart, and built those
    kernels at load, one at a time)."""
    from nimble.runtime.kernels import gemm

    compiled = compile_model(SAMPLES / "transformer.pt", input_specs(["1x64x128"]), device="cpu")
    found = prebuild.walk(compiled.artifact(), H100)
    tiles = collections.Counter()  # the tile is written into the kernel's text: one text per tile
    for kernel, _, constants in found.values():
        if "BLOCK_K" in constants and "in0_ptr" in kernel.source:  # a product with an op after it
            tiles[tuple(constants[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))] += 1
    assert set(tiles) == set(gemm.TILES) and len(set(tiles.values())) == 1, tiles
    apart = [kernel for kernel, _, constants in found.values() if set(constants) == {"N", "BLOCK"}]
    assert len(apart) == tiles[gemm.TILES[0]], [k.source for k in apart]  # each op after a product, alone
