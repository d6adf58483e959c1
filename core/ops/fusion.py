"""Fused ops: several aten ops stored as one op whose body is data, never code.

A fused op is `Op(target=FUSED, args=(body,), outputs=(result,))`. The body is a tuple of nodes
`(target, args, kwargs)`, each an aten call in the IR's own argument form: `Ref(v)` reads graph
value `v`, and `Local(k)` reads the result of the body's node `k`, which must come earlier. The
op's one result is the last node's. Because a body's `Ref`s are ordinary op arguments,
`Op.refs()` lists them and the schedule, the memory plan and the plan checks see the fused op's
true inputs.

Three kinds of body exist, and `check` refuses anything else:
- pointwise: every node is one of POINTWISE, elementwise over tensors that broadcast to the result;
- convolution-led: node 0 is a 2-D convolution (CONVOLUTIONS) reading graph values only, and every
  later node is pointwise;
- concatenation-led: node 0 is a cat (CONCATS) of 1 to MAX_PIECES graph values, and every later
  node is pointwise over tensors that broadcast to the cat's result (`passes/fuse_concats.py`).

On any device nimble can interpret a body node by node with the same aten overloads
(`interpret.run_fused`). On CUDA the runtime lowers it instead (`runtime/kernels/fused.py`): a
convolution-led body to cuDNN's fused convolutions where their pattern matches, and the
pointwise part to one generated Triton kernel, which reads a leading cat's parts where they lie
(the cat's result is never written). This module is plain data and checks; it
imports no torch.
"""

from __future__ import annotations

from ..errors import GraphError
from ..ir import Local, Op, Ref

FUSED = "nimble::fused"
MAX_NODES = 64  # nodes in one body

CONVOLUTIONS = frozenset({"aten::conv2d.default", "aten::convolution.default", "aten::_convolution.default"})
CONCATS = frozenset({"aten::cat.default"})
MAX_PIECES = 64  # parts of a leading cat: each is one pointer parameter of the generated kernel

# Elementwise ops a body may hold, each with its schema as a fused body may use it: its positional
# slots ("tensor": a Ref or Local, "number": an int or float, "number?": that or None), how many of
# them are required, and its keyword-only arguments. Nothing else is accepted, so the CPU, cuDNN
# and generated paths all see the same call. Every non-tensor slot is a number (or None), so every
# op here is elementwise over broadcast operands.
_UNARY_SIGNATURE = (("tensor",), 1, {})
_BINARY_SIGNATURE = (("tensor", "tensor"), 2, {})
SIGNATURES: dict[str, tuple[tuple[str, ...], int, dict[str, str]]] = {
    **{f"aten::{name}.default": _UNARY_SIGNATURE for name in (
        "relu", "relu6", "sigmoid", "silu", "hardswish", "hardsigmoid", "tanh", "neg", "exp", "sqrt", "rsqrt",
        "reciprocal", "abs", "erf")},
    "aten::gelu.default": (("tensor",), 1, {"approximate": "approximate"}),
    "aten::hardtanh.default": (("tensor", "number", "number"), 1, {}),
    "aten::leaky_relu.default": (("tensor", "number"), 1, {}),
    "aten::clamp.default": (("tensor", "number?", "number?"), 1, {}),
    "aten::clamp_min.default": (("tensor", "number"), 2, {}),
    "aten::clamp_max.default": (("tensor", "number"), 2, {}),
    "aten::add.Tensor": (("tensor", "tensor"), 2, {"alpha": "number"}),
    "aten::sub.Tensor": (("tensor", "tensor"), 2, {"alpha": "number"}),
    "aten::mul.Tensor": _BINARY_SIGNATURE, "aten::div.Tensor": _BINARY_SIGNATURE,
    "aten::maximum.default": _BINARY_SIGNATURE, "aten::minimum.default": _BINARY_SIGNATURE,
    "aten::add.Scalar": (("tensor", "number", "number"), 2, {}),
    "aten::sub.Scalar": (("tensor", "number", "number"), 2, {}),
    "aten::mul.Scalar": (("tensor", "number"), 2, {}), "aten::div.Scalar": (("tensor", "number"), 2, {}),
    "aten::pow.Tensor_Scalar": (("tensor", "number"), 2, {}),  # of an exponent in POWERS only
    # of booleans (LOGICAL: a boolean result) and selections by a boolean; a body computes them on 0.0 and 1.0
    "aten::__and__.Tensor": _BINARY_SIGNATURE, "aten::bitwise_and.Tensor": _BINARY_SIGNATURE,
    "aten::logical_and.default": _BINARY_SIGNATURE,
    "aten::where.Scalar": (("tensor", "number", "number"), 3, {}),
    "aten::where.self": (("tensor", "tensor", "tensor"), 3, {}),
    # relu's backward (grad where self > threshold, else 0): in training graphs only (`TRAINING_POINTWISE`)
    "aten::threshold_backward.default": (("tensor", "tensor", "number"), 3, {}),
}
TRAINING_POINTWISE = frozenset({"aten::threshold_backward.default"})  # on the allowlist of training graphs only
LOGICAL = frozenset({"aten::__and__.Tensor", "aten::bitwise_and.Tensor", "aten::logical_and.default"})
SELECTIONS = frozenset({"aten::where.Scalar", "aten::where.self"})  # operand 0 is the boolean condition
# The exponents a fused pow may take: those PyTorch's CUDA kernel computes without calling pow
# (x * x, x * x * x, sqrt, rsqrt, reciprocal), so that the generated kernel gives its result.
POWERS = (2, 3, 0.5, -0.5, -1, -2)
# target -> the positions of its tensor operands
POINTWISE: dict[str, tuple[int, ...]] = {
    target: tuple(i for i, kind in enumerate(slots) if kind == "tensor") for target, (slots, _, _) in SIGNATURES.items()}
FLOATS = frozenset({"float32", "float16", "bfloat16"})  # the dtypes a fused body computes in
_CONV_SIGNATURES = {  # input, weight, bias, then int lists and flags
    "aten::conv2d.default": (("tensor?", "ints", "ints", "ints", "int"), 2),
    "aten::convolution.default": (("tensor?", "ints", "ints", "ints", "bool", "ints", "int"), 9),
    "aten::_convolution.default": (("tensor?", "ints", "ints", "ints", "bool", "ints", "int", "bool", "bool", "bool",
                                    "bool"), 13),
}


def body_of(op: Op) -> tuple:
    return op.args[0]


def nodes_of(op: Op) -> tuple:
    """The (target, args, kwargs) nodes `op` computes: a fused op's body, else the op itself."""
    return body_of(op) if op.target == FUSED else ((op.target, op.args, op.kwargs),)


def is_fused(op: Op) -> bool:
    return op.target == FUSED


def leads_with_convolution(body: tuple) -> bool:
    return body[0][0] in CONVOLUTIONS


def leads_with_concat(body: tuple) -> bool:
    return body[0][0] in CONCATS


def is_pointwise(body: tuple) -> bool:
    """True for a body of elementwise nodes only, with no convolution or cat leading it."""
    return not leads_with_convolution(body) and not leads_with_concat(body)


def check(op: Op) -> None:
    """Raise GraphError naming the first way `op`'s body breaks the rules above."""
    if op.kwargs or len(op.args) != 1 or not isinstance(op.args[0], tuple) or len(op.outputs) != 1 or op.mutates:
        raise GraphError(f"fused op {op.id} is malformed: it takes one body and has one result")
    body = op.args[0]
    if not 1 <= len(body) <= MAX_NODES:
        raise GraphError(f"fused op {op.id} has {len(body)} body nodes; 1 to {MAX_NODES} are allowed")
    for k, node in enumerate(body):
        where = f"fused op {op.id}, body node {k}"
        if not (isinstance(node, tuple) and len(node) == 3 and isinstance(node[0], str)
                and isinstance(node[1], tuple) and isinstance(node[2], tuple)
                and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in node[2])):
            raise GraphError(f"{where} is not (target, args, kwargs)")
        target = node[0]
        if target in CONVOLUTIONS or target in CONCATS:
            if k != 0:
                raise GraphError(f"{where}: a {'convolution' if target in CONVOLUTIONS else 'cat'} may only lead")
        elif target not in POINTWISE:
            raise GraphError(f"{where}: {target!r} is not an op a fused body may hold")
        for a in _leaves((node[1], tuple(v for _, v in node[2]))):
            if isinstance(a, Local) and not 0 <= a.index < k:
                raise GraphError(f"{where} reads local {a.index}, which is not an earlier node")
        problem = _convolution_problem(node) if target in CONVOLUTIONS else _concat_problem(node) \
            if target in CONCATS else pointwise_problem(node)
        if problem:
            raise GraphError(f"{where} ({target}): {problem}")
    for a in _leaves((op.args,)):
        if not isinstance(a, (Ref, Local, int, float, bool, str, type(None))):
            raise GraphError(f"fused op {op.id} holds an argument of kind {type(a).__name__}")


def _number(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def _int(a) -> bool:
    return isinstance(a, int) and not isinstance(a, bool)


_KINDS = {  # slot kind -> what an argument in it may be
    "tensor": lambda a: isinstance(a, (Ref, Local)), "tensor?": lambda a: a is None or isinstance(a, Ref),
    "number": _number, "number?": lambda a: a is None or _number(a), "approximate": lambda a: a in ("none", "tanh"),
    "int": _int, "bool": lambda a: isinstance(a, bool),
    "ints": lambda a: isinstance(a, tuple) and 1 <= len(a) <= 3 and all(_int(n) and 0 <= n <= 2**16 for n in a),
}


def _is(kind: str, a) -> bool:
    return _KINDS[kind](a)


def pointwise_problem(node) -> str | None:
    """What breaks the op's schema (SIGNATURES), or None."""
    target, args, kwargs = node
    slots, required, keywords = SIGNATURES[target]
    if not required <= len(args) <= len(slots):
        return f"takes {required} to {len(slots)} positional arguments, not {len(args)}"
    for i, (kind, a) in enumerate(zip(slots, args)):
        if not _is(kind, a):
            return f"argument {i} must be a {kind.rstrip('?')}{' or None' if kind.endswith('?') else ''}, not {a!r}"
    if target == "aten::clamp.default" and all(a is None for a in args[1:]):
        return "needs min or max (torch refuses a clamp of neither)"
    if target == "aten::pow.Tensor_Scalar" and args[1] not in POWERS:
        return f"an exponent of {args[1]!r} is not fused (only {', '.join(map(str, POWERS))})"
    names = [name for name, _ in kwargs]
    if len(set(names)) != len(names):
        return "a keyword argument is given twice"
    for name, value in kwargs:
        if name not in keywords or not _is(keywords[name], value):
            return f"keyword argument {name}={value!r} is not one the op takes"
    return None


def _convolution_problem(node) -> str | None:
    target, args, kwargs = node
    slots, required = _CONV_SIGNATURES[target]
    if kwargs or not required <= len(args) <= 2 + len(slots) or not all(isinstance(a, Ref) for a in args[:2]):
        return "takes its input and weight as graph values, then its schema's arguments, positionally"
    for i, (kind, a) in enumerate(zip(slots, args[2:]), start=2):
        if not _is(kind, a) and not (kind == "ints" and _is("int", a)):
            return f"argument {i} is {a!r}, not a {kind}"
    return None


def _concat_problem(node) -> str | None:
    target, args, kwargs = node
    if kwargs or len(args) != 2 or not isinstance(args[0], tuple) or not _int(args[1]) or not -8 <= args[1] < 8:
        return "takes its parts as a tuple of graph values, then its dimension, positionally"
    if not 1 <= len(args[0]) <= MAX_PIECES or not all(isinstance(a, Ref) for a in args[0]):
        return f"joins 1 to {MAX_PIECES} graph values, not {len(args[0])} parts of which some are not graph values"
    return None


def _leaves(args: tuple):
    for a in args:
        if isinstance(a, tuple):
            yield from _leaves(a)
        else:
            yield a


def conv_params(target: str, args: tuple | list) -> dict | None:
    """A convolution node's arguments by name, conv2d's defaults filled in; None for a transposed
    or output-padded convolution, which no fused kernel takes."""
    args = list(args)
    if target == "aten::conv2d.default":
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
        defaults = (None, None, None, (1, 1), (0, 0), (1, 1), 1)
        p = dict(zip(names, args + list(defaults[len(args):])))
        if isinstance(p["padding"], str):
            return None  # padding="same"/"valid": its own overload, not this one
        return _pairs(p)
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")
    p = dict(zip(names, args))
    if len(args) < len(names) or p["transposed"] or not isinstance(p["output_padding"], (tuple, list)) \
            or any(p["output_padding"]):
        return None
    return _pairs(p)


def _pairs(p: dict) -> dict | None:
    """stride, padding and dilation as pairs of ints (a single int stands for both)."""
    for key in ("stride", "padding", "dilation"):
        v = p[key]
        v = (v,) if isinstance(v, int) else tuple(v) if isinstance(v, (tuple, list)) else ()
        if len(v) == 1:
            v = v * 2
        if len(v) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in v):
            return None
        p[key] = v
    return p


def convolution_pattern(body: tuple) -> str | None:
    """'relu' for conv -> relu, 'add_relu' for conv -> add(conv, z) -> relu (alpha 1), else None:
    the bodies that map onto cuDNN's fused convolutions."""
    if not leads_with_convolution(body):
        return None
    targets = [node[0] for node in body[1:]]
    if targets == ["aten::relu.default"]:
        return "relu"
    if targets == ["aten::add.Tensor", "aten::relu.default"]:
        alpha = dict(body[1][2]).get("alpha", 1)
        if alpha == 1 and Local(0) in body[1][1][:2] and body[2][1][0] == Local(1):
            return "add_relu"
    return None
