"""`runtime/kernels/casts`: many casts at once. On the CPU the transposed casts' kernel source runs
through `triton_shim` against torch's own casts; on a GPU `copy_all` runs the dense twins through
`_foreach_copy_` and the transposed ones through that kernel, and copies the rest."""

from __future__ import annotations

import pytest
import torch

from nimble.runtime.kernels import casts

from .. import triton_shim

gpu = pytest.mark.gpu


def _values(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 100).to(dtype)


def _columns(pairs, tile):
    args, end = [], 0
    for src, dst in pairs:
        rows, cols = dst.shape
        across = -(-cols // tile)
        end += -(-rows // tile) * across
        args += [src, dst, rows, cols, across, end]
    return args, end


@pytest.mark.parametrize("shapes", [[(70, 130)], [(64, 64), (3, 200), (130, 1), (9, 9)]])
def test_the_columns_source_casts_transposed_views_into_row_major_buffers(shapes):
    # a weight's gradient as a linear's backward leaves it: the transpose of a row-major product
    sources = [_values((c, r), torch.bfloat16, k).t() for k, (r, c) in enumerate(shapes)]
    assert all(s.stride() == (1, s.shape[0]) for s in sources)
    buffers = [torch.full(s, 7.0) for s in shapes]
    args, end = _columns(list(zip(sources, buffers)), 32)
    triton_shim.run_grid(casts.source(len(shapes)), end, *args, TILE=32)
    for src, dst in zip(sources, buffers):
        assert torch.equal(dst, src.float())


def test_the_kinds_take_dense_twins_and_transposed_products_only():
    x = torch.zeros(4, 6)
    assert casts.layout_kind(x, torch.zeros(4, 6, dtype=torch.bfloat16)) == casts.FLAT
    assert casts.layout_kind(x[:, :3], torch.zeros(4, 3)) is None  # a slice: strides of its own
    cl = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    assert casts.layout_kind(cl, torch.zeros_like(cl, dtype=torch.bfloat16)) == casts.FLAT  # twins, both dense
    assert casts.layout_kind(cl, torch.zeros(2, 3, 4, 5)) is None
    assert casts.layout_kind(torch.zeros(6, 4).t(), x) == casts.COLUMNS
    assert casts.layout_kind(torch.zeros(6, 4).t(), torch.zeros(6, 4).t()) == casts.FLAT
    assert casts.layout_kind(torch.zeros(8, 4)[::2].t(), x) is None  # not dense
    assert casts.layout_kind(torch.zeros(4, 1, 6)[:, 0], x) == casts.FLAT  # a size-1 dim's stride is no matter
    assert casts.layout_kind(x, torch.zeros(6, 4)) is None


def test_copy_all_on_the_cpu_is_torch_s_copy():
    sources = [_values((3, 5), torch.float32, 0), _values((5, 3), torch.float32, 1).t()]
    buffers = [torch.empty(3, 5, dtype=torch.bfloat16) for _ in sources]
    assert all(casts.kind_of(s, b) is None for s, b in zip(sources, buffers))  # no kernel off a GPU
    casts.copy_all(sources, buffers)
    for src, dst in zip(sources, buffers):
        assert torch.equal(dst, src.to(torch.bfloat16))


@gpu
def test_copy_all_runs_the_kernels_on_cuda_and_copies_the_rest():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    shapes = [(768, 768), (3072,), (5, 7), (2304, 768)] * 5 + [(1,)]
    sources = [_values(s, torch.float32, k).cuda() for k, s in enumerate(shapes)]
    sources += [_values((c, r), torch.bfloat16, 50 + k).cuda().t() for k, (r, c) in
                enumerate([(768, 3072), (3072, 768), (10, 768), (65, 130)] * 5)]
    conv = _values((8, 4, 3, 3), torch.float32, 99).cuda()  # into a channels_last buffer: copied by torch
    sources.append(conv)
    buffers = [torch.full(s.shape, 7.0, dtype=torch.bfloat16 if s.dtype == torch.float32 else torch.float32,
                          device="cuda") for s in sources[:-1]]
    buffers.append(torch.empty(8, 4, 3, 3, dtype=torch.bfloat16, device="cuda").to(memory_format=torch.channels_last))
    kinds = [casts.kind_of(s, b) for s, b in zip(sources, buffers)]
    assert kinds.count(casts.FLAT) == 21 and kinds.count(casts.COLUMNS) == 20 and kinds[-1] is None
    casts.copy_all(sources, buffers)
    torch.cuda.synchronize()
    for src, dst in zip(sources, buffers):
        assert torch.equal(dst, src.to(dst.dtype))
    launched = [k for k in casts._KERNELS.values() if k.kernel is not None]  # 20 transposed: 16, then 4
    assert launched and not any(k.failed for k in casts._KERNELS.values())
