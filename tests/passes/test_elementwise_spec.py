"""`substitute.binary_spec` works out add, sub and mul's result spec by their shape rule
(`ops/shapes._binary`, in any layout) without running a meta kernel, as torch's meta function
does: checked against the meta op itself on many layouts and dtypes."""

from __future__ import annotations

import random

import torch

from nimble.ir import TensorSpec
from nimble.ops import arguments, targets
from nimble.passes.substitute import binary_spec

SHAPES = [(2, 3, 4, 5), (1, 3, 1, 1), (2, 1, 4, 5), (1, 1, 1, 1), (3, 1), (2, 3, 4), (5,), (4, 5), (2, 3, 1, 5),
          (1, 8, 7, 7), (8, 7, 7), (2, 8, 1, 1)]
DTYPES = ["float32", "float16", "bfloat16", "float64", "int64", "int32", "bool"]


def _strided(shape, rng):
    """Contiguous, channels_last, a transposition or a stride gap: specs a graph can hold."""
    n = len(shape)
    kind = rng.choice(["contiguous", "channels_last", "permuted", "gapped"])
    if kind == "channels_last" and n == 4:
        t = torch.empty(shape, device="meta", memory_format=torch.channels_last)
    elif kind == "permuted" and n > 1:
        order = list(range(n))
        rng.shuffle(order)
        t = torch.empty([shape[k] for k in order], device="meta").permute(*[order.index(k) for k in range(n)])
    elif kind == "gapped":
        t = torch.empty([*shape[:-1], shape[-1] * 2], device="meta")[..., ::2]
    else:
        t = torch.empty(shape, device="meta")
    return tuple(t.stride())


def test_it_agrees_with_the_meta_op():
    rng = random.Random(0)
    checked = 0
    for _ in range(600):
        a, b = rng.choice(SHAPES), rng.choice(SHAPES)
        try:
            torch.broadcast_shapes(a, b)
        except RuntimeError:
            continue
        da, db = rng.choice(DTYPES), rng.choice(DTYPES)
        sa, sb = TensorSpec(a, da, _strided(a, rng)), TensorSpec(b, db, _strided(b, rng))
        for target in ("aten::add.Tensor", "aten::mul.Tensor", "aten::sub.Tensor"):
            if target == "aten::sub.Tensor" and "bool" in (da, db):
                continue
            want = targets.resolve(target)(arguments.meta_tensor(sa), arguments.meta_tensor(sb))
            got = binary_spec(target, sa, sb)
            assert (got.shape, got.strides) == (tuple(want.shape), tuple(want.stride())), (target, sa, sb)
            assert got.dtype == str(want.dtype).removeprefix("torch."), (target, sa, sb)
            checked += 1
    assert checked > 800
