"""A training step's attention on CUDA by cuDNN's fused attention (or FlashAttention-2's), not by
the memory-efficient kernels it is traced as.

A step traces `scaled_dot_product_attention` as `_scaled_dot_product_efficient_attention` and its
backward (`frontend/joint.attention_kernels`): every result of that pair is a tensor, which the
IR takes, where cuDNN's and flash's results include sizes as numbers. On an H200 in bf16 at
vit_b_16's shapes (batch 32, 12 heads, 197 tokens, 64 per head) the efficient pair takes 266 us a
layer, FlashAttention-2's 204; torch.compile's step runs cuDNN's, about 84 (2.86 against 1.00 ms
over the 12 layers, `tools/train_step_kernels.py`, 2026-11-30).

Here each such pair (`pairs`: a forward with no mask and no dropout whose logsumexp only its own
backwards read, as the trace wires them) runs as one library's kernels, chosen by the forward's
first call outside a capture (a step's first call is eager): cuDNN's where it takes the call and
its result agrees with the efficient kernel's, else flash's on the same terms, else the efficient
kernel as traced, from then on. The choice is per pair and lasts for the step. Each backward
follows its forward's choice. Only half precision is taken (bf16 and fp16: neither library has
float32 kernels), with rows of at most 128 elements, a multiple of 8.

Forward and backward pass cuDNN's (or flash's) logsumexp between them in the bytes of the traced
value (batch x heads x queries rounded up to 32, float32): laid out as that library's own, which
is contiguous and no larger, in its first elements. Nothing else reads that value (`pairs`).
"""

from __future__ import annotations

import torch

from ...ir import Graph, Ref

EFFICIENT = "aten::_scaled_dot_product_efficient_attention.default"
EFFICIENT_BACKWARD = "aten::_scaled_dot_product_efficient_attention_backward.default"
CUDNN, FLASH, TRACED = "cudnn", "flash", "efficient"
LIBRARIES = (CUDNN, FLASH)  # tried in this order (the faster first, on an H200)
MAX_DIM = 128  # elements of a query, key or value row
# views that only rename a tensor: the trace may save the forward's results through them
ALIASES = frozenset({"aten::detach.default", "aten::alias.default"})
AGREE = 0.05  # largest |difference| from the efficient kernel's result, in units of its largest |value|


class Pair:
    """One forward and its backwards: the library they run, decided by the forward's first call
    (`choose`)."""

    def __init__(self, lse_shape: tuple[int, ...]):
        self.lse_shape = lse_shape  # the traced logsumexp's: (batch, heads, queries rounded up)
        self.library: str | None = None

    def forward(self, q, k, v, bias, compute_lse, dropout_p, is_causal, scale=None):
        if self.library is None:
            if torch.cuda.is_current_stream_capturing():  # no trial inside a capture: as traced
                return _efficient(q, k, v, bias, compute_lse, dropout_p, is_causal, scale)
            self.library = self.choose(q, k, v, bias, compute_lse, dropout_p, is_causal, scale)
        if self.library == TRACED:
            return _efficient(q, k, v, bias, compute_lse, dropout_p, is_causal, scale)
        out, lse, seed, offset = _run(self.library, q, k, v, is_causal, scale)
        held = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        held.view(-1)[:lse.numel()].view(lse.shape).copy_(lse)
        return out, held, seed, offset

    def backward(self, grad_out, q, k, v, bias, out, lse, seed, offset, dropout_p, mask, is_causal, scale=None):
        if self.library in (None, TRACED):
            return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                grad_out, q, k, v, bias, out, lse, seed, offset, dropout_p, mask, is_causal, scale=scale)
        b, h, n, s = q.size(0), q.size(1), q.size(2), k.size(2)
        aten = torch.ops.aten
        if self.library == CUDNN:
            own = lse.view(-1)[:b * h * n].view(b, h, n, 1)
            grads = aten._scaled_dot_product_cudnn_attention_backward(
                grad_out, q, k, v, out, own, seed, offset, None, None, None, n, s, 0.0, is_causal, scale=scale)
        else:
            own = lse.view(-1)[:b * h * n].view(b, h, n)
            grads = aten._scaled_dot_product_flash_attention_backward(
                grad_out, q, k, v, out, own, None, None, n, s, 0.0, is_causal, seed, offset, scale=scale)
        # the efficient kernel gives no tensor for a gradient its mask leaves out (nor the mask's)
        return [g for g, wanted in zip(grads, mask) if wanted]

    def choose(self, q, k, v, bias, compute_lse, dropout_p, is_causal, scale) -> str:
        """The first library of LIBRARIES that takes this call and whose result agrees with the
        efficient kernel's (within AGREE of its largest magnitude); else TRACED."""
        if not q.is_cuda or not takes(q, k, v, bias, compute_lse, dropout_p):
            return TRACED
        want = _efficient(q, k, v, bias, compute_lse, dropout_p, is_causal, scale)[0].float()
        for library in LIBRARIES:
            try:
                got = _run(library, q, k, v, is_causal, scale)[0].float()
            except RuntimeError:  # this torch, cuDNN or GPU does not take the shapes
                continue
            if got.shape == want.shape and \
                    (got - want).abs().max().item() <= AGREE * max(want.abs().max().item(), 1e-3):
                return library
        return TRACED


def takes(q, k, v, bias, compute_lse, dropout_p) -> bool:
    """Whether the call is one the libraries' kernels may take: half precision, 4-D, no mask, no
    dropout, rows of at most MAX_DIM elements (a multiple of 8)."""
    return (bias is None and compute_lse and dropout_p == 0.0
            and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
            and q.dim() == k.dim() == v.dim() == 4 and q.size(-1) == k.size(-1) == v.size(-1)
            and q.size(-1) <= MAX_DIM and q.size(-1) % 8 == 0)


def _efficient(q, k, v, bias, compute_lse, dropout_p, is_causal, scale):
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, compute_lse, dropout_p, is_causal,
                                                                  scale=scale)


def _run(library: str, q, k, v, is_causal, scale):
    """(out, logsumexp, seed, offset) of `library`'s forward: its logsumexp as it gives it."""
    aten = torch.ops.aten
    if library == CUDNN:
        r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False, scale=scale)
    else:
        r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    return r[0], r[1], r[6], r[7]


def pairs(graph: Graph) -> dict[int, Pair]:
    """op id -> its pair's `Pair`, for each forward of EFFICIENT with no mask and no dropout whose
    results but its output are read only by backwards of EFFICIENT_BACKWARD that take its output,
    logsumexp, seed and offset as their own (a pair as the trace makes it), and for those
    backwards; a forward read any other way is left as traced."""
    readers = graph.readers()
    found: dict[int, Pair] = {}
    for op in graph.ops:
        if op.target != EFFICIENT or len(op.outputs) != 4 or len(op.args) < 6:
            continue
        if op.args[3] is not None or op.args[4] is not True or op.args[5] not in (0, 0.0):
            continue
        out, lse, seed, offset = op.outputs
        spec, query = graph.values[lse].spec, op.args[0]
        if not isinstance(query, Ref) or len(spec.shape) != 3 or any(graph.root(v) != v for v in op.outputs):
            continue
        b, h, n = graph.values[query.id].spec.shape[:3]
        if tuple(spec.shape[:2]) != (b, h) or spec.shape[2] < n:  # no room for the libraries' logsumexp
            continue
        users = readers.get(lse, set()) | readers.get(seed, set()) | readers.get(offset, set())
        backs = [graph.ops[u] for u in sorted(users) if graph.ops[u].target not in ALIASES]
        if not backs or not all(_backward_of(graph, b, op.args[:3], out, lse, seed, offset) for b in backs):
            continue
        pair = Pair(tuple(spec.shape))
        found[op.id] = pair
        found.update((b.id, pair) for b in backs)
    return found


def _backward_of(graph: Graph, op, qkv, out, lse, seed, offset) -> bool:
    """Whether `op` is a backward of EFFICIENT of these query, key and value that reads the
    forward's results (or aliases of them: the trace may detach what the backward saves) only
    where the forward's own backward does."""
    if op.target != EFFICIENT_BACKWARD or len(op.args) < 10:
        return False

    def root(a):
        return graph.root(a.id) if isinstance(a, Ref) else a

    def same(a, b):  # one tensor, or views of one storage at one place with one shape and strides
        return a == b or isinstance(a, Ref) and isinstance(b, Ref) and graph.root(a.id) == graph.root(b.id) \
            and graph.values[a.id].spec == graph.values[b.id].spec

    if not all(same(a, b) for a, b in zip(op.args[1:4], qkv)) or op.args[4] is not None \
            or [root(a) for a in op.args[5:9]] != [out, lse, seed, offset]:
        return False
    rest = [a for k, a in enumerate(op.args) if k not in (5, 6, 7, 8)] + [a for _, a in op.kwargs]
    return op.args[9] in (0, 0.0) and not any(root(a) in (lse, seed, offset) for a in rest if isinstance(a, Ref))
