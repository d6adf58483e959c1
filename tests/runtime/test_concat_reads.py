"""A body led by a cat (`passes/fuse_concats.py`) runs as one generated kernel that reads each
part where it lies (`codegen.concat_source`): on the CPU through `triton_shim`, which raises on
any access outside a buffer, and on CUDA against eager, in both layouts and at odd sizes."""

import ast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nimble.ir import Local, Op, Ref
from nimble.ops import fusion, interpret
from nimble.runtime.kernels import codegen
from nimble.runtime.kernels import fused as kernels
from nimble.runtime.kernels import generated as machinery

from .. import triton_shim
from ..models import DenseBlock


def cat_led(pieces, dim, scale, shift):
    """The body densenet's layers get, tensors in place of Refs: cat, then x * scale + shift, relu."""
    return ((("aten::cat.default", (tuple(pieces), dim), ()),
             ("aten::mul.Tensor", (Local(0), scale), ()),
             ("aten::add.Tensor", (Local(1), shift), ()),
             ("aten::relu.default", (Local(2),), ())))


def layout(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t.contiguous()


def generated(body, out):
    pieces, dim = list(body[0][1][0]), body[0][1][1]
    tiles = codegen.ConcatTiles(out, pieces, dim)
    assert tiles.fits
    operands = codegen.pointwise_operands(body, skip_first=True)
    source = codegen.concat_source(body, out, pieces, tiles, operands)
    ast.parse(source)
    triton_shim.run_grid(source, tiles.programs, out, *pieces, *operands)
    return out


@settings(max_examples=40, deadline=None, derandomize=True)
@given(widths=st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(sum), batch=st.integers(1, 3),
       height=st.integers(1, 5), width=st.integers(1, 6), channels_last=st.booleans(), dim=st.sampled_from([1, 0, 3]))
def test_the_kernel_reads_every_part_where_it_lies(widths, batch, height, width, channels_last, dim):
    """Each element of the result comes from its part, for parts of any width (empty ones too),
    joined along channels, images or columns, in either layout."""
    g = torch.Generator().manual_seed(sum(widths) + batch)
    base = [batch, 4, height, width]
    pieces = []
    for n in widths:
        shape = list(base)
        shape[dim] = n
        pieces.append(layout(torch.randn(shape, generator=g), channels_last))
    joined = torch.cat(pieces, dim)
    scale = torch.randn([n if d == 1 else 1 for d, n in enumerate(joined.shape)], generator=g)
    shift = torch.randn(scale.shape, generator=g)
    body = cat_led(pieces, dim, scale, shift)
    out = layout(torch.empty(joined.shape), channels_last)
    torch.testing.assert_close(generated(body, out), interpret.run_fused(body), rtol=1e-6, atol=1e-6)


def test_parts_that_are_not_dense_in_the_result_s_order_are_not_tiled():
    x = torch.randn(2, 3, 4, 5)
    mixed = [x, torch.randn(2, 2, 4, 5).contiguous(memory_format=torch.channels_last)]
    assert not codegen.ConcatTiles(torch.empty(2, 5, 4, 5), mixed, 1).fits
    strided = [x, torch.randn(2, 4, 4, 5)[:, ::2]]
    assert not codegen.ConcatTiles(torch.empty(2, 5, 4, 5), strided, 1).fits
    assert codegen.ConcatTiles(torch.empty(2, 5, 4, 5), [x, torch.randn(2, 2, 4, 5)], 1).fits


def test_tiles_cover_runs_of_a_densenet_layer_in_channels_last():
    """growth 32 in channels_last: runs of 32 channels, 32 positions to a program."""
    pieces = [torch.empty(8, 64, 56, 56, device="meta").contiguous(memory_format=torch.channels_last)] + \
        [torch.empty(8, 32, 56, 56, device="meta").contiguous(memory_format=torch.channels_last)] * 3
    out = torch.empty(8, 160, 56, 56, device="meta").contiguous(memory_format=torch.channels_last)
    tiles = codegen.ConcatTiles(out, pieces, 1)
    assert (tiles.cols, tiles.rows, tiles.outer, tiles.width) == (32, 32, 8 * 56 * 56, 160)
    assert tiles.programs == (8 * 56 * 56 // 32) * (2 + 1 + 1 + 1)


def test_a_result_past_2_31_elements_gets_64_bit_indices():
    pieces = [torch.empty(2**20, 1500, device="meta"), torch.empty(2**20, 600, device="meta")]
    out = torch.empty(2**20, 2100, device="meta")
    tiles = codegen.ConcatTiles(out, pieces, 1)
    body = ((("aten::cat.default", (tuple(pieces), 1), ()), ("aten::relu.default", (Local(0),), ())))
    assert "tl.program_id(0).to(tl.int64)" in codegen.concat_source(body, out, pieces, tiles, [])
    small = [torch.empty(4, 3, device="meta")] * 2
    source = codegen.concat_source(body, torch.empty(4, 6, device="meta"), small,
                                   codegen.ConcatTiles(torch.empty(4, 6, device="meta"), small, 1), [])
    assert "p = tl.program_id(0)\n" in source


def test_a_forged_cat_along_another_dimension_is_refused_at_load_in_one_line(tmp_path):
    """A cat-led body whose parts do not join along its (forged) dimension passes the schema
    checks; the load's check of every op against its declared shapes refuses it before it runs."""
    import nimble
    from nimble.errors import ArtifactError
    from nimble.formats.artifact import encode
    from nimble.frontend import quiet_torchscript
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs

    from ..forge import edit_json

    torch.manual_seed(0)
    with quiet_torchscript():
        torch.jit.save(torch.jit.trace(DenseBlock().eval(), torch.randn(2, 5, 7, 9)), str(tmp_path / "m.pt"))
    blob = encode(compile_model(tmp_path / "m.pt", input_specs(["2x5x7x9"]), device="cpu").artifact())

    def forge(doc):
        led = [op for op in doc["ops"] if op["target"] == fusion.FUSED and op["args"][0][0][0] == "aten::cat.default"]
        led[1]["args"][0][0][1][1] = 2  # two parts of 5 and 3 channels, joined along the rows

    path = tmp_path / "forged.nimble"
    path.write_bytes(edit_json(blob, "graph.json", forge))
    with pytest.raises(ArtifactError, match="rejects its declared inputs") as info:
        nimble.load(path, "cpu")
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("widths", [(5, 3, 3, 3), (1,), (64, 32, 32)])
def test_the_compiled_kernel_agrees_with_eager_and_writes_its_buffer(channels_last, widths):
    torch.manual_seed(0)
    pieces = [layout(torch.randn(3, n, 7, 9, device="cuda"), channels_last) for n in widths]
    channels = sum(widths)
    scale, shift = torch.randn(1, channels, 1, 1, device="cuda"), torch.randn(1, channels, 1, 1, device="cuda")
    body = cat_led(pieces, 1, scale, shift)
    refs = tuple(Ref(k) for k in range(len(pieces)))
    n = len(pieces)
    op = Op(0, fusion.FUSED, (((("aten::cat.default", (refs, 1), ()),
                                ("aten::mul.Tensor", (Local(0), Ref(n)), ()),
                                ("aten::add.Tensor", (Local(1), Ref(n + 1)), ()),
                                ("aten::relu.default", (Local(2),), ()))),), (), (n + 2,), (), (), "test")
    fusion.check(op)
    fallbacks = len(machinery.STATS.fallbacks)
    out = layout(torch.empty(3, channels, 7, 9, device="cuda"), channels_last)
    got = kernels.FusedKernel(op)([body], out)
    assert got is out and len(machinery.STATS.fallbacks) == fallbacks, machinery.STATS.fallbacks[fallbacks:]
    torch.testing.assert_close(out, torch.relu(torch.cat(pieces, 1) * scale + shift), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_a_dense_block_runs_without_copying_its_cats(tmp_path, monkeypatch):
    """End to end: the loaded block agrees with eager in both layouts, and its graph holds one
    cat kernel (the cat read twice) where it held five."""
    import nimble
    from nimble.runtime.tune import choices as tuning
    from nimble.runtime.executable import Executable
    from nimble.runtime.base.streams import count_kernels

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    module = DenseBlock().eval()
    x = torch.randn(2, 5, 7, 9)
    with torch.no_grad():
        want = [t.cuda() for t in module(x)]
    artifact = nimble.Nimble(module.cuda()).prepare(x.cuda())._runner.artifact
    assert sum(op.target == "aten::cat.default" for op in artifact.graph.ops) == 1
    fallbacks = len(machinery.STATS.fallbacks)
    for channels_last in (False, True):
        dump = tmp_path / f"graph{channels_last}.dot"
        choice = tuning.Choice(layout="channels_last" if channels_last else "contiguous", streams="serial")
        exe = Executable(artifact, "cuda", choice=choice, graph_dump=str(dump))
        for got, w in zip(exe(x.cuda()), want, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-5)
        blocks = dump.read_text(errors="replace").split("KERNEL")[1:]
        assert sum("CatArrayBatchedCopy" in b for b in blocks) == 1, count_kernels(dump)  # `twice`
    assert len(machinery.STATS.fallbacks) == fallbacks, machinery.STATS.fallbacks[fallbacks:]
