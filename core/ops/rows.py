"""Proof that a graph computes each row of its batch from that row alone, by one function for every
row (`batches.py` then checks that the graphs of a multi-batch artifact are one program).

`nimble serve` packs the rows of several clients into one call of a multi-batch artifact and hands
row r of each output back to the client that sent row r. That is safe only if no op mixes rows, and
if no op treats one row position differently from another. `batch_rows(graph, b)` proves both by
following the batch through the graph: for every value, which dimension holds the rows (`Rows`), or
None for a value that no row reaches (weights and what is computed from them alone). Each op has a
rule (by its aten name and the names of its schema's arguments) that says where its results hold
the rows, or refuses it: an op that reduces, sorts, rolls, indexes or normalizes along the rows, a
value shared by every row that is broadcast along them (row r would get its r-th slice), a write of
rows into such a value, an op nimble has no rule for.

A dimension may hold rows together with more: `Rows(axis, inner)` says that dimension `axis` has
b * inner entries, row r owning [r * inner, (r + 1) * inner) (a flattened batch of heads, say).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import GraphError
from ..ir import Graph, Op, Ref, refs_of
from . import fusion
from .targets import named_arguments as arguments


@dataclass(frozen=True)
class Rows:
    axis: int
    inner: int = 1


class RowsError(GraphError):
    """A graph that does not keep the rows of its batch apart; the message names the op."""


POINTWISE = frozenset({
    "add", "sub", "rsub", "mul", "div", "neg", "pow", "sqrt", "rsqrt", "exp", "log", "abs", "reciprocal", "erf",
    "sin", "cos", "floor", "ceil", "round", "sign", "where", "lerp", "addcmul", "addcdiv", "maximum", "minimum",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "masked_fill", "bitwise_not",
    "bitwise_and", "bitwise_or", "__and__", "__or__", "relu", "relu6", "leaky_relu", "elu", "selu", "gelu", "silu",
    "mish", "sigmoid", "tanh", "hardtanh", "hardswish", "hardsigmoid", "softplus", "clamp", "clamp_min",
    "clamp_max", "to", "_to_copy", "type_as", "clone", "detach", "alias", "contiguous", "zeros_like", "ones_like",
    "full_like", "copy", "expand_as", "fill", "zero"})
ALONG_DIM = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum", "sort", "topk", "flip",
                       "roll", "narrow", "slice", "chunk", "split", "split_with_sizes", "tril", "triu"})
REDUCTIONS = frozenset({"mean", "sum", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std", "norm",
                        "linalg_vector_norm", "logsumexp"})
RESHAPES = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze"})
SPATIAL = {"max_pool1d": 1, "avg_pool1d": 1, "adaptive_avg_pool1d": 1, "max_pool2d": 2, "max_pool2d_with_indices": 2,
           "avg_pool2d": 2, "adaptive_avg_pool2d": 2, "_adaptive_avg_pool2d": 2, "adaptive_max_pool2d": 2,
           "upsample_nearest2d": 2, "upsample_bilinear2d": 2, "reflection_pad2d": 2, "replication_pad2d": 2,
           "max_pool3d": 3, "avg_pool3d": 3, "adaptive_avg_pool3d": 3, "pixel_shuffle": 3}
CONVOLUTIONS = frozenset({"_convolution", "convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                          "conv_transpose2d"})
# ops whose rule reads each operand's rows itself
INDEXED = frozenset({"bmm", "baddbmm", "matmul", "addmm", "einsum", "scaled_dot_product_attention", "index_select",
                     "gather", "embedding", "index"})


def name_of(target: str) -> str:
    """`aten::add_.Tensor` -> `add` (an in-place variant follows its functional op's rule)."""
    name = target.split("::", 1)[-1].split(".", 1)[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


class _Walk:
    """One pass over a graph of batch `batch`, giving every value its Rows or None."""

    def __init__(self, graph: Graph, batch: int):
        self.g, self.b = graph, batch
        self.rows: dict[int, Rows | None] = {v: None for v in range(len(graph.values))}
        for i in graph.inputs:
            self.rows[i] = Rows(0)

    def shape(self, vid: int) -> tuple[int, ...]:
        return self.g.values[vid].spec.shape

    def refuse(self, op: Op, why: str):
        where = f" ({op.source})" if op.source else ""
        raise RowsError(f"op {op.id} {op.target}{where} {why}; a multi-batch artifact needs every row computed from "
                        "that row alone")

    # ------------------------------------------------------------------------ shared rules
    def broadcast(self, op: Op, operands, out_shape, found: Rows | None = None) -> Rows | None:
        """Rows of an elementwise result of `out_shape` (`found`: where it holds them already):
        batched operands must hold the rows at the same aligned dimension; an operand no row
        reaches must not vary along it."""
        n = len(out_shape)
        for vid in operands:
            r, shape = self.rows[vid], self.shape(vid)
            if r is not None:
                at = Rows(r.axis + n - len(shape), r.inner)
                if found not in (None, at):
                    self.refuse(op, "combines values that hold the rows in different dimensions")
                found = at
        for vid in operands:
            shape = self.shape(vid)
            k = None if found is None else found.axis - (n - len(shape))
            if self.rows[vid] is None and k is not None and k >= 0 and shape[k] != 1:
                self.refuse(op, f"broadcasts value {vid}, which no row reaches, along the rows: each row would get "
                            "another slice of it")
        return found

    def dims(self, op: Op, dims, ndim: int) -> list[int]:
        dims = [dims] if isinstance(dims, int) else list(dims or ())
        if not all(type(d) is int and -ndim <= d < max(ndim, 1) for d in dims):
            self.refuse(op, f"names dimensions {dims} outside its input's {ndim}")
        return [d % max(ndim, 1) for d in dims]

    def not_along(self, op: Op, r: Rows, dims: list[int], what: str = "works") -> None:
        if r.axis in dims:  # the op reads across these dimensions
            self.refuse(op, f"{what} along the dimension that holds the rows")

    def reshaped(self, op: Op, r: Rows, before, after) -> Rows:
        """Rows after a reshape: the rows stay blocks of one dimension only if the dimensions
        outside them keep their product (row-major order)."""
        outer = math.prod(before[:r.axis])
        for j, n in enumerate(after):
            if math.prod(after[:j]) == outer and n != 1 and n % self.b == 0:
                return Rows(j, n // self.b)
            if math.prod(after[:j]) > outer:
                break
        self.refuse(op, f"reshapes {list(before)} to {list(after)}, which spreads the rows over several dimensions")

    # ------------------------------------------------------------------------ one op
    def op(self, op: Op) -> None:
        if op.target == fusion.FUSED:
            self.rows[op.outputs[0]] = self.fused(op)
            return
        name, a = name_of(op.target), arguments(op)
        if not any(self.rows[v] is not None for v in op.refs()):
            if name == "expand":  # a shared value spread along the rows is the same in every row
                self.rows[op.outputs[0]] = self.spread(op)
            return  # nothing of any row: every result is None
        outs = self.rule(op, name, a)
        for vid, r in zip(op.outputs, outs):
            if r is not None and not (0 <= r.axis < len(self.shape(vid))
                                      and self.shape(vid)[r.axis] == self.b * r.inner):
                self.refuse(op, f"gives result {vid} of shape {list(self.shape(vid))}, which cannot hold the rows at "
                            f"dimension {r.axis}")
            self.rows[vid] = r
        for vid in op.mutates:
            if self.rows[vid] != (outs[0] if outs else None):
                self.refuse(op, f"writes rows into value {vid}, which holds them otherwise or not at all")

    def rule(self, op: Op, name: str, a: dict) -> list:
        out = [self.shape(v) for v in op.outputs]
        tensors = list(op.refs())
        first = next((v.id for v in a.values() if isinstance(v, Ref)), tensors[0])
        r, shape = self.rows[first], self.shape(first)
        if name in ("max", "min") and "other" in a:
            name = "maximum"  # max.other, min.other: elementwise
        if name in ("to", "type_as"):
            tensors = [first]  # a second tensor gives only its dtype
        if name in POINTWISE or name == "maximum":
            return [self.broadcast(op, tensors, out[0])] * len(out)
        if name in ("new_zeros", "new_ones", "new_full"):
            return [r if r is not None and out[0] == shape else None]
        self.only(op, first, tensors, name)
        if name in ALONG_DIM:
            if name == "slice" and self.dims(op, a["dim"], len(shape)) == [r.axis] and a["start"] in (None, 0) \
                    and a["step"] == 1 and (a["end"] is None or a["end"] >= shape[r.axis]):
                return [r]  # the whole of it: x[:]
            dims = [-2, -1] if name in ("tril", "triu") else a.get("dims", a.get("dim", -1))
            if name == "roll" and not dims:
                self.refuse(op, "rolls the flattened tensor")
            self.not_along(op, r, self.dims(op, dims, len(shape)))
            return [r] * len(out)
        if name in REDUCTIONS:
            dims = self.dims(op, a.get("dim"), len(shape))
            if not dims:
                self.refuse(op, "reduces over every dimension, the rows among them")
            self.not_along(op, r, dims, "reduces")
            keep = a.get("keepdim", False)
            return [r if keep else Rows(r.axis - sum(d < r.axis for d in dims), r.inner)] * len(out)
        if name in RESHAPES:
            return [self.reshaped(op, r, shape, out[0])]
        if name in ("permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis", "t"):
            return [Rows(self.permutation(op, name, a, len(shape)).index(r.axis), r.inner)]
        if name in ("expand", "repeat"):
            at = r.axis + len(out[0]) - len(shape)
            if out[0][at] != shape[r.axis]:
                self.refuse(op, "repeats along the rows")
            return [Rows(at, r.inner)]
        if name in ("select", "unbind"):
            d = self.dims(op, a["dim"], len(shape))[0]
            self.not_along(op, r, [d], "selects")
            return [Rows(r.axis - (d < r.axis), r.inner)] * len(out)
        if name in ("cat", "concat", "stack"):
            d = a["dim"] % (len(out[0]))
            if name != "stack":
                self.not_along(op, r, [d], "concatenates")
            return [Rows(r.axis + (name == "stack" and d <= r.axis), r.inner)]
        if name in ("pad", "constant_pad_nd"):
            self.not_along(op, r, list(range(len(shape) - len(a["pad"]) // 2, len(shape))), "pads")
            return [r]
        if name in SPATIAL:
            self.not_along(op, r, list(range(len(shape) - SPATIAL[name], len(shape))))
            return [r] * len(out)
        if name in ("channel_shuffle", "native_channel_shuffle", "batch_norm", "_native_batch_norm_legit_no_training"):
            if name == "batch_norm" and a["training"]:
                self.refuse(op, "normalizes with the batch's own statistics")
            self.not_along(op, r, [1], "works per channel, which is")
            return [r] + [None] * (len(out) - 1)  # a batch norm's saved statistics hold no rows
        if name in ("layer_norm", "native_layer_norm", "rms_norm"):
            self.not_along(op, r, list(range(len(shape) - len(a["normalized_shape"]), len(shape))), "normalizes")
            return [r] * len(out)
        if name in ("group_norm", "native_group_norm", "instance_norm") or name in CONVOLUTIONS:
            if r.axis != 0 or (name in CONVOLUTIONS and len(shape) != len(self.shape(a["weight"].id))):
                self.refuse(op, "takes its input's first dimension as the samples, and the rows are not there")
            return [r] * len(out)
        if name in ("linear", "mm"):
            self.not_along(op, r, [len(shape) - 1], "contracts")
            return [r]
        if name in INDEXED:
            return [self.indexed(op, name, a)]
        self.refuse(op, "has no rule that proves it keeps rows apart")

    def spread(self, op: Op) -> Rows | None:
        """Where an expand of a value no row reaches gives a dimension the batch's size: rows in
        which every row sees the same data, as a batched value would hold them."""
        before, after = self.shape(op.args[0].id), self.shape(op.outputs[0])
        for j, n in enumerate(after):
            k = j - (len(after) - len(before))
            if (k < 0 or before[k] == 1) and n != 1 and n % self.b == 0:
                return Rows(j, n // self.b)
        return None

    def only(self, op: Op, first: int, tensors: list[int], name: str) -> None:
        """Past the pointwise ops, the rows come from the first tensor; another that holds rows must
        hold them alike (cat, stack) or is refused, unless the op's rule reads it (`indexed`)."""
        if name in INDEXED:
            return
        r, joins = self.rows[first], name in ("cat", "concat", "stack")
        for vid in tensors:
            if joins and self.rows[vid] != r:
                self.refuse(op, f"joins value {vid}, which holds the rows otherwise or not at all, to the rows")
            if not joins and vid != first and self.rows[vid] is not None:
                self.refuse(op, f"reads rows from value {vid} besides its input")
        if r is None:
            self.refuse(op, "reads rows only through an operand whose rows it cannot follow")

    def permutation(self, op: Op, name: str, a: dict, n: int) -> list[int]:
        """The result's dimensions as input dimensions."""
        order = list(range(n))
        if name == "permute":
            order = self.dims(op, a["dims"], n)
            if sorted(order) != list(range(n)):
                self.refuse(op, "permutes with a list that is not a permutation")
        elif name == "t":
            order.reverse()
        elif name in ("movedim", "moveaxis"):
            src, dst = self.dims(op, a["source"], n), self.dims(op, a["destination"], n)
            rest = iter(d for d in range(n) if d not in src)
            placed = dict(zip(dst, src))
            order = [placed[k] if k in placed else next(rest) for k in range(n)]
        else:
            i, j = self.dims(op, [a["dim0"], a["dim1"]], n)
            order[i], order[j] = order[j], order[i]
        return order

    def indexed(self, op: Op, name: str, a: dict) -> Rows:
        """Matrix products, attention and lookups: the rows must sit in a dimension that the op
        keeps apart (a batch dimension of the product, a row of the left operand, an index)."""
        rows, shapes = self.rows, self.shape
        if name == "einsum":
            return self.einsum(op, a)
        if name in ("bmm", "baddbmm"):
            x, y = a["self" if name == "bmm" else "batch1"], a["mat2" if name == "bmm" else "batch2"]
            if rows[x.id] is None or rows[x.id] != rows[y.id] or rows[x.id].axis != 0:
                self.refuse(op, "multiplies matrices that do not both hold the rows in their first dimension")
            if name == "baddbmm":
                self.broadcast(op, [x.id, a["self"].id], self.shape(op.outputs[0]))
            return rows[x.id]
        if name == "scaled_dot_product_attention":
            q = rows[a["query"].id]
            if q is None or q.axis >= len(shapes(a["query"].id)) - 2 or \
                    any(rows[a[k].id] != q for k in ("key", "value")):
                self.refuse(op, "attends across the rows")
            mask = [a["attn_mask"].id] if isinstance(a["attn_mask"], Ref) else []
            return self.broadcast(op, [a["query"].id, *mask], shapes(op.outputs[0]))
        if name == "matmul":
            return self.matmul(op, a["self"].id, a["other"].id)
        if name == "addmm":
            if getattr(rows[a["mat1"].id], "axis", None) != 0 or rows[a["mat2"].id] is not None:
                self.refuse(op, "contracts along the rows")
            return self.broadcast(op, [a["mat1"].id, a["self"].id], shapes(op.outputs[0]))
        # lookups: a table no row reaches read at indices that hold the rows, or the other way round
        if name == "embedding":
            if rows[a["weight"].id] is not None:
                self.refuse(op, "looks up a table that holds the rows")
            return rows[a["indices"].id]
        if name == "index_select":
            x, i = rows[a["self"].id], rows[a["index"].id]
            if x is not None and i is None:
                self.not_along(op, x, self.dims(op, a["dim"], len(shapes(a["self"].id))), "selects")
                return x
            if x is None and i is not None:
                return Rows(self.dims(op, a["dim"], len(shapes(a["self"].id)))[0], i.inner)
            self.refuse(op, "selects rows by rows")
        if name == "gather":
            x, i = rows[a["self"].id], rows[a["index"].id]
            if x is None or x != i:
                self.refuse(op, "gathers across the rows")
            self.not_along(op, x, self.dims(op, a["dim"], len(shapes(a["self"].id))), "gathers")
            return x
        # index: x[..., idx, ...] with shared index tensors after the rows' dimension, side by side
        x, given = rows[a["self"].id], list(a["indices"])
        used = [k for k, t in enumerate(given) if t is not None]
        if x is None or any(rows[t.id] is not None for t in given if t is not None) or not used or \
                used[0] <= x.axis or used != list(range(used[0], used[-1] + 1)):
            self.refuse(op, "indexes along or with the rows")
        return x

    def matmul(self, op: Op, x: int, y: int) -> Rows:
        """torch.matmul: the rows in a batch dimension (broadcast as elementwise ops do), in the
        left operand's matrix rows or in the right one's columns, never where it contracts."""
        rx, ry = self.rows[x], self.rows[y]
        nx, ny, n = len(self.shape(x)), len(self.shape(y)), len(self.shape(op.outputs[0]))
        if (rx is not None and (nx == 1 or rx.axis == nx - 1)) or (ry is not None and ry.axis == max(ny - 2, 0)):
            self.refuse(op, "contracts along the rows")
        if rx is not None and rx.axis == nx - 2:
            if ry is not None:
                self.refuse(op, "multiplies rows by rows")
            return Rows(n - 1 if ny == 1 else n - 2, rx.inner)
        if ry is not None and ry.axis == ny - 1:
            if rx is not None:
                self.refuse(op, "multiplies rows by rows")
            return Rows(n - 1, ry.inner)
        lead = [(v, max(len(self.shape(v)) - 2, 0)) for v in (x, y) if len(self.shape(v)) > 1]
        m = n - (2 if nx > 1 and ny > 1 else 1)  # the result's batch dimensions
        found = None
        for v, k in lead:
            if self.rows[v] is not None:
                at = Rows(self.rows[v].axis + m - k, self.rows[v].inner)
                if found not in (None, at):
                    self.refuse(op, "multiplies values that hold the rows in different dimensions")
                found = at
        for v, k in lead:
            j = found.axis - (m - k)
            if self.rows[v] is None and j >= 0 and self.shape(v)[j] != 1:
                self.refuse(op, f"broadcasts value {v}, which no row reaches, along the rows")
        return found

    def einsum(self, op: Op, a: dict) -> Rows:
        equation, operands = str(a["equation"]).replace(" ", ""), list(a["tensors"])
        ins, arrow, out = equation.partition("->")
        terms = ins.split(",")
        if "." in equation or len(terms) != len(operands):
            self.refuse(op, "is an einsum with an ellipsis, which nimble does not follow")
        if not arrow:
            out = "".join(sorted(c for c in set(ins) if c.isalpha() and ins.count(c) == 1))
        letter, inner = None, None
        for term, t in zip(terms, operands):
            r = self.rows[t.id]
            if r is not None and len(term) == len(self.shape(t.id)):
                if letter not in (None, term[r.axis]) or inner not in (None, r.inner):
                    self.refuse(op, "multiplies values that hold the rows under different letters")
                letter, inner = term[r.axis], r.inner
        if letter is None or letter not in out or any(
                self.rows[t.id] is None and letter in term for term, t in zip(terms, operands)):
            self.refuse(op, "sums over the rows, or reads them where its equation does not follow them")
        return Rows(out.index(letter), inner)

    def fused(self, op: Op) -> Rows | None:
        """A fused body: a convolution or a cat first (its own rule), then elementwise nodes
        broadcast to the result; every graph value a later node reads is checked against the
        result's rows."""
        body, found = op.args[0], None
        head, rest = body[0], body
        if head[0] in fusion.CONVOLUTIONS or head[0] in fusion.CONCATS:
            rest = body[1:]
            if any(self.rows[v] is not None for v in refs_of(tuple(head[1]))):
                head_op = Op(op.id, head[0], head[1], head[2], op.outputs, source=op.source)
                found = self.rule(head_op, name_of(head[0]), arguments(head_op))[0]
        return self.broadcast(op, sorted(set(refs_of(tuple(n[1] for n in rest)))), self.shape(op.outputs[0]), found)


def batch_rows(graph: Graph, batch: int) -> dict[int, Rows | None]:
    """Where each value of a graph of batch `batch` (its inputs' first dimension) holds its rows;
    RowsError unless every op keeps the rows apart and every output holds them in its first
    dimension, one entry a row."""
    walk = _Walk(graph, batch)
    for op in graph.ops:
        walk.op(op)
    for k, vid in enumerate(graph.outputs):
        if walk.rows[vid] != Rows(0):
            raise RowsError(f"output {k} ('{graph.values[vid].name}') does not hold one row of the batch per entry of its "
                            "first dimension")
    return walk.rows
