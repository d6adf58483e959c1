"""Every shape rule agrees with the op's own meta kernel: same shape, dtype and strides where it
answers, and a refusal wherever the meta kernel refuses."""

import random

import pytest
import torch

from nimble.ops import arguments, shapes, targets
from nimble.ops.elementwise import COMPARISONS

META = torch.device("meta")


def t(shape, dtype=torch.float32, transpose=False):
    x = torch.empty(shape, dtype=dtype, device=META)
    return x.transpose(-1, -2) if transpose and x.dim() >= 2 else x


def shape(rng, dims, lo=1, hi=9):
    return [rng.randint(lo, hi) for _ in range(dims)]


def cases(target, rng):
    """(args, kwargs) for `target`, many of them invalid on purpose."""
    name = target.split("::")[1].split(".")[0]
    dtype = rng.choice([torch.float32, torch.float32, torch.float16, torch.int64])
    if target in ("aten::add.Tensor", "aten::sub.Tensor", "aten::mul.Tensor", "aten::div.Tensor",
                  "aten::maximum.default", "aten::minimum.default"):
        a = shape(rng, rng.randint(1, 4), 1, 4)
        b = [n if rng.random() < 0.6 else rng.choice([1, 2]) for n in a[rng.randint(0, len(a) - 1):]]
        other = t(b, rng.choice([dtype, torch.float32])) if rng.random() < 0.8 else rng.choice([2, 0.5])
        if "maximum" in target or "minimum" in target:
            other = other if isinstance(other, torch.Tensor) else t(b, dtype)
        if rng.random() < 0.2:  # a traced Python number: a 0-d tensor of another dtype
            other = t([], rng.choice([torch.float64, torch.float32, torch.int64]))
        first = t(a, dtype, rng.random() < 0.2)
        if isinstance(other, torch.Tensor) and rng.random() < 0.3:
            first, other = other, first  # the smaller operand first
        elif isinstance(other, torch.Tensor) and other.dim() > 0 and rng.random() < 0.3:
            other = other.expand(first.shape) if rng.random() < 0.5 and other.dim() <= first.dim() \
                and all(o in (1, f) for o, f in zip(other.shape[::-1], first.shape[::-1])) \
                else other.transpose(0, -1)  # strided: expand_as (F.normalize), or a transposed view
        return [first, other], ({"alpha": 1} if name in ("add", "sub") else {})
    if target in ("aten::add.Scalar", "aten::sub.Scalar", "aten::mul.Scalar", "aten::div.Scalar", "aten::rsub.Scalar"):
        x = t(shape(rng, rng.randint(0, 4), 1, 4), dtype, rng.random() < 0.2)
        return [x, rng.choice([2, 0.5, -3, True])], {}
    if target == "aten::pow.Tensor_Scalar":
        return [t(shape(rng, rng.randint(0, 4), 1, 4), dtype, rng.random() < 0.2), rng.choice([2, 3, 0.5, -1.0, True])], {}
    if name == "roll":
        x = t(shape(rng, rng.randint(1, 4), 1, 5), dtype, rng.random() < 0.3)
        if rng.random() < 0.2 and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        dims = rng.sample(range(x.dim()), rng.randint(1, x.dim()))
        shifts = [rng.randint(-3, 3) for _ in dims] if rng.random() < 0.9 else [1, 2, 3, 4, 5]
        return ([x, shifts, dims] if rng.random() < 0.8 else [x, shifts[:1]]), {}
    if name in ("__and__", "__or__", "bitwise_and", "bitwise_or", "logical_and", "logical_or", "logical_not",
                "bitwise_not", "where", *COMPARISONS):
        kind = rng.choice([torch.bool, torch.bool, torch.bool, torch.int64, torch.int32, torch.float32, torch.float16])
        a = shape(rng, rng.randint(0, 4), 1, 4)
        b = [n if rng.random() < 0.6 else rng.choice([1, 2]) for n in a[rng.randint(0, len(a)):]]

        def operand(s):
            x = t(s, kind if rng.random() < 0.8 else rng.choice([torch.bool, torch.int64, torch.float32]),
                  rng.random() < 0.2)
            if rng.random() < 0.15 and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            return x
        first, other = operand(a), operand(b)
        if rng.random() < 0.3:
            first, other = other, first
        if name in ("logical_not", "bitwise_not"):
            return [first], {}
        if name == "where":
            condition = t(a if rng.random() < 0.5 else b, torch.bool if rng.random() < 0.9 else torch.uint8)
            number = rng.choice([0.0, 1.5, 2, -1, True])
            kinds = {"self": (first, other), "Scalar": (number, rng.choice([0.5, 3, -2.0])),
                     "ScalarSelf": (number, other), "ScalarOther": (first, number)}
            return [condition, *kinds[target.split(".")[1]]], {}
        if target.endswith(".Scalar"):
            return [first, rng.choice([0, 1.5, -2, True])], {}
        return [first, other], {}
    if target in ("aten::linear.default",):
        k = rng.randint(1, 6)
        x = t(shape(rng, rng.randint(1, 3)) + [k if rng.random() < 0.9 else k + 1], dtype)
        if rng.random() < 0.3 and x.dim() >= 3:
            x = t([x.shape[0], x.shape[2], x.shape[1], *x.shape[3:]], dtype).transpose(1, 2)  # a permuted view
        w = t([rng.randint(1, 6), k], dtype)
        return [x, w, t([w.shape[0]], dtype) if rng.random() < 0.5 else None], {}
    if target == "aten::addmm.default":
        n, m, p = shape(rng, 3)
        return [t(rng.choice([[p], [n, p], [1, p]]), dtype), t([n, m], dtype), t([m if rng.random() < 0.9 else m + 1, p], dtype)], {}
    if target in ("aten::mm.default", "aten::bmm.default"):
        batch = [rng.randint(1, 3)] if "bmm" in target else []
        n, m, p = shape(rng, 3)
        other = [b if rng.random() < 0.9 else b + 1 for b in batch] + [m if rng.random() < 0.9 else m + 1, p]
        first = t(batch + [n, m], dtype, rng.random() < 0.3)
        return [first, t(other, dtype if rng.random() < 0.9 else torch.float16, rng.random() < 0.3)], {}
    if target == "aten::matmul.default":
        batch = shape(rng, rng.randint(0, 2), 1, 3)
        n, m, p = shape(rng, 3)
        other_batch = [b if rng.random() < 0.7 else 1 for b in batch]
        return [t(batch + [n, m], dtype, rng.random() < 0.3), t(other_batch + [m if rng.random() < 0.9 else m + 1, p], dtype, rng.random() < 0.3)], {}
    if name in ("max_pool2d", "avg_pool2d"):
        k = rng.randint(1, 4)
        s = rng.choice([[], [rng.randint(1, 3)]])
        p = rng.randint(0, 2)
        x = t(shape(rng, rng.choice([3, 4]), 1, 12), dtype)
        if name == "max_pool2d":
            return [x, [k], s, [p], [rng.randint(1, 2)], rng.random() < 0.5], {}
        return [x, [k], s, [p], rng.random() < 0.5, True, None], {}
    if name == "adaptive_avg_pool2d":
        x = t(shape(rng, rng.choice([3, 4]), 1, 12), dtype)
        if x.dim() == 4 and rng.random() < 0.4:  # channels_last, or a permuted map as swin_t's
            x = x.contiguous(memory_format=torch.channels_last) if rng.random() < 0.5 else \
                t([x.shape[0], x.shape[2], x.shape[3], x.shape[1]], dtype).permute(0, 3, 1, 2)
        return [x, shape(rng, 2, 1, 5) if rng.random() < 0.7 else [1, 1]], {}
    if target == "aten::mean.dim":
        x = t(shape(rng, rng.randint(1, 4)), dtype)
        return [x, rng.sample(range(-x.dim(), x.dim()), rng.randint(1, x.dim())) if rng.random() < 0.9 else [0, 0],
                rng.random() < 0.5], {}
    if target in ("aten::norm.ScalarOpt_dim", "aten::linalg_vector_norm.default"):
        x = t(shape(rng, rng.randint(1, 4)), dtype)
        dims = rng.sample(range(-x.dim(), x.dim()), rng.randint(1, x.dim())) if rng.random() < 0.9 else [0, 0]
        if "linalg" in target and rng.random() < 0.3:
            dims = None
        return [x, rng.choice([2, 1, 3.0]), dims, rng.random() < 0.5], {}
    if target == "aten::scaled_dot_product_attention.default":
        batch, (n, s, e, ev) = shape(rng, rng.randint(1, 2), 1, 4), shape(rng, 4, 1, 9)
        q = t(batch + [n, e], dtype, rng.random() < 0.3)
        k = t(batch + [s, e if rng.random() < 0.9 else e + 1], dtype, rng.random() < 0.3)
        v = t(batch + [s, ev], dtype, rng.random() < 0.3)
        kwargs = {"scale": 0.5} if rng.random() < 0.3 else {}
        if rng.random() < 0.5:  # a mask: of the query's dtype, boolean or another; broadcast, or not
            scores = batch + [n, s]
            mask_shape = [m if rng.random() < 0.6 else 1 for m in scores[rng.randint(0, len(scores) - 1):]]
            if rng.random() < 0.15:
                mask_shape[-1] += 1
            mask = t(mask_shape, rng.choice([dtype, torch.bool, torch.float64]))
            causal = rng.random() < 0.15
            if rng.random() < 0.5:
                return [q, k, v, mask, 0.0, causal], kwargs
            return [q, k, v], {**kwargs, "attn_mask": mask, "is_causal": causal}
        return [q, k, v], kwargs
    if target == "aten::embedding.default":
        ids = torch.randint(0, 10, shape(rng, rng.randint(1, 3)), dtype=rng.choice([torch.int64, torch.int32]),
                            device="meta")
        return [t([10, rng.randint(1, 8)], dtype), ids], {}
    if name in ("zeros_like", "ones_like", "full_like"):
        x = t(shape(rng, rng.randint(0, 4)), rng.choice([dtype, torch.int64]), rng.random() < 0.2)
        kwargs = {"dtype": rng.choice([None, torch.float16, torch.int32])}
        if rng.random() < 0.2:
            kwargs["memory_format"] = torch.contiguous_format
        return ([x, 1.5] if name == "full_like" else [x]), kwargs
    if name == "cat":
        dims = rng.choice([1, 2, 3, 4, 4, 4])
        style = rng.choice(["plain", "channels_last", "channels_last", "sliced", "mixed"])  # of 4-D parts
        base = shape(rng, dims)
        d = rng.randrange(dims)
        parts = []
        for _ in range(rng.randint(1, 4)):
            s = list(base)
            s[d] = rng.randint(1, 5)
            if rng.random() < 0.1:
                s[(d + 1) % dims] += 1
            part = t(s, dtype)
            if rng.random() < 0.2 and dims > 1:  # a strided part: transposed or expanded (ViT's class token)
                part = t([s[1], s[0], *s[2:]], dtype).transpose(0, 1) if rng.random() < 0.5 \
                    else t([1, *s[1:]], dtype).expand(*s)
            elif dims == 4 and style != "plain" and rng.random() < 0.9:  # channels_last, or strided (swin_t)
                part = part.contiguous(memory_format=torch.channels_last) if style == "channels_last" \
                    or (style == "mixed" and rng.random() < 0.5) \
                    else t([s[0], 2 * s[1], 2 * s[2], s[3]], dtype)[:, rng.randint(0, 1)::2, rng.randint(0, 1)::2]
            parts.append(part)
        return [parts, d - dims if rng.random() < 0.5 else d], {}
    if target == "aten::softmax.int":
        x = t(shape(rng, rng.randint(1, 4)), dtype)
        return [x, rng.randrange(x.dim()), None], {}
    if target == "aten::_softmax.default":
        x = t(shape(rng, rng.randint(1, 4)), dtype)
        return [x, rng.randrange(x.dim()), False], {}
    if name == "batch_norm":
        x = t(shape(rng, rng.randint(2, 4)), dtype)
        c = x.shape[1] if rng.random() < 0.9 else x.shape[1] + 1
        return [x, t([c], dtype), t([c], dtype), t([c], dtype), t([c], dtype), rng.random() < 0.2, 0.1, 1e-5, True], {}
    if name == "layer_norm":
        x = t(shape(rng, rng.randint(1, 4)), dtype, rng.random() < 0.3)
        norm = list(x.shape[-rng.randint(1, x.dim()):])
        w = t(norm if rng.random() < 0.9 else [n + 1 for n in norm], dtype)
        return [x, norm, w, t(norm, dtype), 1e-5, False], {}
    if name in ("convolution", "conv1d", "conv2d", "conv3d"):
        dims = {"conv1d": 1, "conv2d": 2, "conv3d": 3}.get(name, rng.randint(1, 3))
        groups = rng.choice([1, 1, 2])
        cin, cout = groups * rng.randint(1, 3), groups * rng.randint(1, 3)
        transposed = name == "convolution" and rng.random() < 0.3
        k = shape(rng, dims, 1, 3)
        w = t([cin, cout // groups, *k] if transposed else [cout, cin // groups if rng.random() < 0.95 else cin + 1, *k],
              dtype)
        x = t(([1] if rng.random() < 0.8 else []) + [cin] + shape(rng, dims, 1, 9), dtype)
        bias = t([cout]) if rng.random() < 0.5 else None
        stride, padding, dilation = [rng.randint(1, 2)], [rng.randint(0, 2)], [rng.randint(1, 2)]
        if name == "convolution":
            return [x, w, bias, stride, padding, dilation, transposed, [0], groups], {}
        return [x, w, bias, stride, padding, dilation, groups], {}
    # unary
    x = t(shape(rng, rng.randint(0, 4)), dtype, rng.random() < 0.2)
    extra = {"hardtanh": [-1.0, 1.0], "clamp": [0.0, 6.0], "clamp_min": [0.0], "clamp_max": [1.0],
             "leaky_relu": [0.1], "elu": [1.0, 1.0, 1.0], "softplus": [1.0, 20.0], "gelu": []}.get(name, [])
    return [x, *extra], ({"approximate": "none"} if name == "gelu" else {})


def describe(x: torch.Tensor):
    return tuple(x.shape), x.dtype, tuple(s if n > 1 else None for n, s in zip(x.shape, x.stride()))


@pytest.mark.parametrize("target", sorted(shapes.RULES))
def test_rule_agrees_with_the_meta_kernel(target):
    rng = random.Random(target)
    fn = targets.resolve(target)
    answered = 0
    for _ in range(150):
        args, kwargs = cases(target, rng)
        try:
            ours = shapes.infer(target, args, kwargs)
        except (ValueError, RuntimeError):
            ours = "refused"
        if ours is None:
            continue
        try:
            theirs = arguments.flatten_result(fn(*args, **kwargs))
        except Exception:
            theirs = "refused"
        if ours == "refused" or theirs == "refused":
            assert ours == theirs, (target, args, kwargs, ours, theirs)
            continue
        answered += 1
        assert [describe(x) for x in ours] == [describe(x) for x in theirs], (target, args, kwargs)
    assert answered >= 20, f"{target}: the rule answered only {answered} cases"
