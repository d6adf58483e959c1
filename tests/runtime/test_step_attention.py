"""`runtime/kernels/step_attention`: a training step's attention, traced as the memory-efficient
kernel and its backward, runs as cuDNN's (or flash's) kernels on CUDA where they take it. Which
pairs qualify is decided on the graph (CPU tests); the kernels' results against the efficient
kernel's are checked on a GPU."""

from __future__ import annotations

import pytest
import torch

from nimble.frontend.builder import GraphBuilder
from nimble.ir import Graph, TensorSpec
from nimble.runtime.kernels import step_attention as sa

FORWARD = torch.ops.aten._scaled_dot_product_efficient_attention.default._schema
BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default._schema


def _graph(dropout: float = 0.0, masked: bool = False, lse_read: bool = False, backwards: int = 1) -> Graph:
    """A forward of the efficient kernel on (2, 2, 40, 8) bf16 and `backwards` backwards of it, wired
    as a step's trace wires them (output and logsumexp saved through detaches); `masked`: with an additive
    mask; `lse_read`: its logsumexp also read by another op."""
    b = GraphBuilder("m", training=True)
    shape = (2, 2, 40, 8)
    q, k, v, g = (b.add_input(n, TensorSpec(shape, "bfloat16")) for n in "qkvg")
    mask = b.add_input("mask", TensorSpec((2, 2, 40, 40), "bfloat16")) if masked else None
    fw = b.emit(FORWARD, sa.EFFICIENT, [q, k, v, mask, True, dropout, False, 0.35], "m.py:1")
    saved = [b.op("aten::detach.default", [r], "m.py:1") for r in fw[:2]] + fw[2:]
    outputs = []
    for _ in range(backwards):
        bw = b.emit(BACKWARD, sa.EFFICIENT_BACKWARD, [g, q, k, v, mask, *saved, dropout, [True, True, True, masked],
                                                      False, 0.35], "m.py:2")
        outputs += [r for r in bw if r is not None]
    if lse_read:
        outputs.append(b.op("aten::exp.default", [fw[1]], "m.py:3"))
    inputs = [q, k, v, g] + ([mask] if masked else [])
    return Graph(tuple(b.values), tuple(b.ops), tuple(r.id for r in inputs), tuple(r.id for r in outputs))


def test_a_forward_and_the_backwards_that_read_its_logsumexp_share_one_pair():
    graph = _graph(backwards=2)
    found = sa.pairs(graph)
    forward, *backwards = [op.id for op in graph.ops if op.target in (sa.EFFICIENT, sa.EFFICIENT_BACKWARD)]
    assert sorted(found) == [forward, *backwards] and len(backwards) == 2
    assert len({id(p) for p in found.values()}) == 1
    assert found[forward].lse_shape == graph.values[graph.ops[forward].outputs[1]].spec.shape
    assert found[forward].library is None  # chosen by the forward's first call


@pytest.mark.parametrize("case", [{"dropout": 0.1}, {"masked": True}, {"lse_read": True}])
def test_attention_with_dropout_a_mask_or_a_logsumexp_read_elsewhere_stays_as_traced(case):
    assert sa.pairs(_graph(**case)) == {}


def test_the_libraries_take_half_precision_rows_of_up_to_128_elements_with_no_mask_or_dropout():
    def takes(dtype=torch.bfloat16, dim=64, bias=None, lse=True, dropout=0.0):
        q = torch.empty(2, 2, 8, dim, dtype=dtype, device="meta")
        return sa.takes(q, q, q, bias, lse, dropout)

    assert takes()
    assert takes(torch.float16, 128)
    assert not takes(torch.float32)
    assert not takes(dim=160) and not takes(dim=60)
    assert not takes(bias=torch.empty(0)) and not takes(dropout=0.1) and not takes(lse=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("library", sa.LIBRARIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_library_gives_the_efficient_kernel_s_output_and_gradients(library, dtype):
    """At 197 queries (not a multiple of 32: the logsumexp's traced buffer is padded) and a packed
    projection's strides, as vit_b_16's, and with one gradient left out by the backward's mask."""
    torch.manual_seed(0)
    b, h, n, d = 4, 3, 197, 64
    qkv = torch.randn(b, n, 3, h, d, device="cuda", dtype=dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    grad = torch.randn(b, h, n, d, device="cuda", dtype=dtype)
    want = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=0.125)
    want_grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, want[0], want[1], want[2], want[3], 0.0, [True, True, True, False], False, scale=0.125)
    pair = sa.Pair(tuple(want[1].shape))
    pair.library = library
    try:
        got = pair.forward(q, k, v, None, True, 0.0, False, scale=0.125)
    except RuntimeError as e:  # this GPU's torch or cuDNN lacks the library's kernels: a pair would decline it
        pytest.skip(f"{library}: {e}")
    assert got[1].shape == want[1].shape and got[0].shape == want[0].shape
    assert (got[0].float() - want[0].float()).abs().max() <= 2e-2
    grads = pair.backward(grad, q, k, v, None, *got, 0.0, [True, True, True, False], False, scale=0.125)
    assert len(grads) == 3
    for g, w in zip(grads, want_grads):
        assert (g.float() - w.float()).abs().max() <= 3e-2 * max(w.float().abs().max().item(), 1.0)
    fewer = pair.backward(grad, q, k, v, None, *got, 0.0, [True, False, True, False], False, scale=0.125)
    assert len(fewer) == 2 and torch.equal(fewer[1], grads[2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_pair_chooses_a_library_on_its_first_call_and_declines_float32():
    torch.manual_seed(0)
    q = torch.randn(2, 2, 40, 64, device="cuda", dtype=torch.bfloat16)
    lse_shape = (2, 2, 64)
    half = sa.Pair(lse_shape)
    half.forward(q, q, q, None, True, 0.0, False, scale=None)
    assert half.library in sa.LIBRARIES
    single = sa.Pair(lse_shape)
    single.forward(q.float(), q.float(), q.float(), None, True, 0.0, False, scale=None)
    assert single.library == sa.TRACED
