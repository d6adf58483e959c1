"""Inference graphs: nn.MultiheadAttention as torch.export records it (its general path: about 25
view, copy and select ops around two linears and scaled dot-product attention) becomes the ops of
its inference fast path, the ops a trace of it records, so both frontends give the same op graph.

A block is found by its shape (batch-first self-attention: a transpose of the input, one packed
input projection, attention without a mask, dropout, causality or scale, one output projection,
a transpose back) and then proven: its movement ops are run on index tensors, and they must place
every element exactly where the fast path does. Any block that differs stays as it is.
"""

from __future__ import annotations

import math

import torch

from ..ir import ACTIVATION, WEIGHT, Graph, Op, Ref, TensorSpec, Value, refs_of
from ..ops import arguments, attention, shapes, targets, types
from .rewrite import Facts
from .substitute import rebuild

_MOVES = {"aten::transpose", "aten::unflatten", "aten::unsqueeze", "aten::squeeze", "aten::contiguous", "aten::select",
          "aten::view", "aten::reshape", "aten::permute", "aten::_unsafe_view", "aten::clone", "aten::expand"}
_LINEAR, _ATTENTION = attention.LINEAR, attention.ATTENTION
_META, _CPU = torch.device("meta"), torch.device("cpu")
PROOF_LIMIT = 2**28  # elements of the input projection's result; a larger block stays op by op


def match_multi_head_attention(graph: Graph) -> Graph:
    """Replace each proven block with the fast path's ops, at the place of the block's last op."""
    readers = Facts(graph).readers
    blocks = [b for b in (_block(graph, op, readers) for op in graph.ops if op.target == _ATTENTION) if b]
    if not blocks:
        return graph
    emit = _Emitter(graph)
    ops, same, added, removed = [], {}, {}, set()
    last_of = {b["ops"][-1]: b for b in blocks}
    for b in blocks:
        removed.update(b["ops"])
    # weights only a block reads: placed where the new ops first read them, as the builder places them
    moved = {w for b in blocks for w in b["weights"] if readers[w] <= set(b["ops"])}
    for op in graph.ops:
        if op.id in last_of:
            b = last_of[op.id]
            new_ops, values, result = emit.fast_path(b, op.source, moved)
            ops.extend(new_ops)
            added[op.outputs[0]] = values
            same[op.outputs[0]] = result
        elif op.id not in removed:
            ops.append(op)
    kept = [v for v in graph.values if v.id not in moved]
    return rebuild(graph, ops, same, values=kept, added=added)


def _block(graph: Graph, attention: Op, readers) -> dict | None:
    """The ops of one nn.MultiheadAttention general path around `attention`, proven to compute
    what the fast path computes, with its input, sizes and weights; else None."""
    values = graph.values
    q, k, v, mask, dropout, causal, *rest = attention.args + (None,) * 3
    if mask is not None or dropout != 0 or causal or any(a not in (None, False) for a in rest) \
            or any(val not in (None, False) for _, val in attention.kwargs):
        return None
    # backwards from q, k and v through movement ops to one input projection
    inside, stack, projection = set(), [r for r in (q, k, v) if isinstance(r, Ref)], None
    if len(stack) != 3:
        return None
    while stack:
        producer = values[stack.pop().id].producer
        if producer is None:
            return None
        op = graph.ops[producer]
        if op.target == _LINEAR and projection in (None, op.id):
            projection = op.id
            continue
        if _base(op) not in _MOVES or len(list(op.refs())) != 1:
            return None
        if op.id in inside:  # q, k and v share their first views of the projection
            continue
        inside.add(op.id)
        stack.extend(Ref(r) for r in op.refs())
    if projection is None:
        return None
    proj_in = graph.ops[projection]
    first = _producer(graph, proj_in.args[0])
    if first is None or first.target != "aten::transpose.int" or not isinstance(first.args[0], Ref) \
            or sorted(a % 3 for a in first.args[1:3]) != [0, 1]:
        return None
    x = first.args[0]
    # forwards from the attention through movement ops, the output projection, and back to batch first
    chain, at, proj_out, last = [], attention.outputs[0], None, None
    while last is None:
        after = readers.get(at, set())
        if len(after) != 1 or at in graph.outputs:
            return None
        op = graph.ops[next(iter(after))]
        if op.target == _LINEAR and proj_out is None and op.args[0] == Ref(at):
            proj_out = op
        elif _base(op) not in _MOVES or len(list(op.refs())) != 1:
            return None
        chain.append(op.id)
        at = op.outputs[0]
        if proj_out is not None and op.target == "aten::transpose.int" \
                and values[at].spec.shape == values[x.id].spec.shape:
            last = op
    members = sorted({first.id, projection, *inside, attention.id, *chain})
    inner = [o for m in members[:-1] for o in graph.ops[m].outputs]  # read by the block alone
    if members[-1] != last.id or any(r not in members for o in inner for r in readers.get(o, ())) \
            or any(o in graph.outputs for o in inner) or any(graph.ops[m].mutates for m in members):
        return None
    found = _weights(graph, proj_in, proj_out, values[x.id].spec, values[attention.outputs[0]].spec)
    if found is None:
        return None
    embed, heads, w, b, pw, pb = found
    block = {"ops": members, "x": x, "embed": embed, "heads": heads, "w": w, "b": b, "pw": pw, "pb": pb,
             "weights": [r for r in (w, b, pw, pb) if r is not None]}
    try:
        proven = _proven(graph, block, first, proj_in, attention, proj_out, chain, inside)
    except (RuntimeError, ValueError, IndexError):  # a movement op that refuses these sizes: no proof
        proven = False
    return block if proven else None


def _weights(graph: Graph, proj_in: Op, proj_out: Op, x: TensorSpec, attended: TensorSpec):
    """(embed, heads, in weight, in bias, out weight, out bias) if both projections read weights of
    the packed shapes nn.MultiheadAttention has."""
    if len(x.shape) != 3 or len(attended.shape) != 4 or len(proj_in.args) < 3 or len(proj_out.args) < 3:
        return None
    embed = x.shape[-1]
    ids = [a.id if isinstance(a, Ref) else a if a is None else -1 for a in (*proj_in.args[1:3], *proj_out.args[1:3])]
    if -1 in ids or ids[0] is None or ids[2] is None \
            or any(i is not None and graph.values[i].kind != WEIGHT for i in ids):
        return None
    shapes_ = [None if i is None else graph.values[i].spec.shape for i in ids]
    if shapes_[0] != (3 * embed, embed) or shapes_[2] != (embed, embed) or shapes_[1] not in (None, (3 * embed,)) \
            or shapes_[3] not in (None, (embed,)):
        return None
    return (embed, attended.shape[1], *ids)


def _proven(graph, block, first, proj_in, attention, proj_out, chain, inside) -> bool:
    """Run the block's movement ops on index tensors: q, k and v must hold the very elements of
    the input projection that the fast path's split and head reshape give them, and the result
    must hold, row for row, what the fast path's output projection reads."""
    x = graph.values[block["x"].id].spec.shape
    batch, length, embed = x
    heads = block["heads"]
    if 3 * batch * length * embed > PROOF_LIMIT:
        return False
    rows_t = _indices((batch, length)).transpose(0, 1).reshape(-1)  # the x row of each row of xᵀ
    got = _run(graph, sorted(inside), {proj_in.outputs[0]: _indices(graph.values[proj_in.outputs[0]].spec.shape)})
    fast = _indices((batch, length, 3 * embed))
    for k, r in enumerate(attention.args[:3]):
        want = fast.split(embed, -1)[k].reshape(batch, length, heads, -1).transpose(1, 2)
        have = got.get(r.id)
        if have is None or have.shape != want.shape:
            return False
        row, col = rows_t[torch.div(have, 3 * embed, rounding_mode="floor").long()], have % (3 * embed)
        if not (torch.equal(row, torch.div(want, 3 * embed, rounding_mode="floor"))
                and torch.equal(col, want % (3 * embed))):
            return False
    attended = _indices(graph.values[attention.outputs[0]].spec.shape)
    out_at = chain.index(proj_out.id)
    read = _run(graph, chain[:out_at], {attention.outputs[0]: attended}).get(proj_out.args[0].id)
    spec = graph.values[proj_out.outputs[0]].spec
    written = _run(graph, chain[out_at + 1:], {proj_out.outputs[0]: _indices(spec.shape)})
    final = written.get(graph.ops[chain[-1]].outputs[0])
    if read is None or final is None or final.shape != (batch, length, embed) or read.shape[-1] != embed:
        return False
    if not torch.equal(final % embed, _indices((embed,)).expand(batch, length, embed)):
        return False  # the columns of each row stay in order
    rows = read.reshape(-1, embed)[torch.div(final[..., 0], embed, rounding_mode="floor").long()]
    return torch.equal(rows, attended.transpose(1, 2).reshape(batch, length, embed))


def _indices(shape) -> torch.Tensor:
    """Each element's own flat index, in a tensor of `shape`."""
    return torch.arange(math.prod(shape), dtype=torch.int32).reshape(*shape)


def _run(graph: Graph, op_ids: list[int], tensors: dict) -> dict:
    """Run movement ops on CPU tensors (indices), in program order."""
    tensors = dict(tensors)
    for i in op_ids:
        op = graph.ops[i]
        if any(r not in tensors for r in op.refs()):
            return {}
        args, kwargs = arguments.op_arguments(op, tensors, _CPU)
        for o, t in zip(op.outputs, arguments.flatten_result(targets.resolve(op.target)(*args, **kwargs))):
            tensors[o] = t
    return tensors


def _base(op: Op) -> str:
    return op.target.split(".")[0]


def _producer(graph: Graph, arg) -> Op | None:
    if not isinstance(arg, Ref) or graph.values[arg.id].producer is None:
        return None
    return graph.ops[graph.values[arg.id].producer]


class _Emitter:
    """New ops typed on the meta device, as the frontend's builder types them: a result that is a
    view of a value's storage aliases that value's root."""

    def __init__(self, graph: Graph):
        self.values: dict[int, Value] = {v.id: v for v in graph.values}
        self.meta: dict[int, torch.Tensor] = {}
        self.root_of: dict[int, int] = {}  # id(meta storage tensor) -> root value id
        self.next_value, self.next_op = len(graph.values), len(graph.ops)

    def tensor(self, vid: int) -> torch.Tensor:
        """Value `vid` on the meta device: a view of its root's storage."""
        if vid not in self.meta:
            v = self.values[vid]
            if v.alias_of is not None:
                self.meta[vid] = arguments.meta_tensor(v.spec, self.tensor(v.alias_of)._base)
            else:
                self.meta[vid] = t = arguments.meta_tensor(v.spec)
                self.root_of[id(t._base)] = vid
        return self.meta[vid]

    def fast_path(self, b: dict, source: str, moved: set[int]):
        """The fast path's ops for self-attention (`ops.attention`), as the TorchScript frontend
        emits them, and their values (weights that only the block read placed where these ops
        first read them). Returns (ops, values, the result's value id)."""
        self.ops, self.new = [], []
        self.moved, self.placed = moved, set()
        batch, length, _ = self.values[b["x"].id].spec.shape
        packed = self.op(attention.LINEAR, [b["x"], Ref(b["w"]), _ref(b["b"])], source)[0]
        q, k, v = self.op(attention.SPLIT, [packed, b["embed"], -1], source)
        result = attention.attend(lambda target, args: self.op(target, args, source)[0], q, k, v, batch, length,
                                  b["embed"], b["heads"], lambda x: self.values[x.id].spec.shape[1],
                                  Ref(b["pw"]), _ref(b["pb"]))
        return self.ops, self.new, result.id

    def op(self, target: str, given: list, source: str) -> list[Ref]:
        schema = targets.resolve(target)._schema
        args, kwargs = arguments.by_schema(schema, list(given) + [a.default_value
                                                                  for a in schema.arguments[len(given):]])
        for r in (a for a in args if isinstance(a, Ref)):
            if r.id in self.moved and r.id not in self.placed:  # a weight: placed at its first reader
                self.new.append(self.values[r.id])
                self.placed.add(r.id)
        used = {r: self.tensor(r) for r in refs_of(tuple(args))}
        call_args = [arguments.to_torch(a, used, _META) for a in args]
        call_kwargs = {k: arguments.to_torch(a, used, _META) for k, a in kwargs}
        results = shapes.results(target, call_args, call_kwargs)
        passed = {id(t): r for r, t in used.items()}
        if len(results) == 1 and id(results[0]) in passed:  # the op hands back its input: nothing to run
            return [Ref(passed[id(results[0])])]
        same = arguments.same_view(schema, args, results, used)
        if same is not None:  # a view with its input's exact geometry: nothing to run
            return [Ref(same)]
        op_id, outs = self.next_op, []
        self.next_op += 1
        name = f"{target.split('::')[-1].split('.')[0]}_{op_id}"
        for t in results:
            alias = self.root_of.get(id(t._base)) if t._is_view() else None
            vid = self.next_value
            self.next_value += 1
            spec = TensorSpec(tuple(t.shape), types.dtype_name(t.dtype), tuple(t.stride()), t.storage_offset())
            value = Value(vid, ACTIVATION, spec, name, op_id, alias)
            self.values[vid], self.meta[vid] = value, t
            self.root_of.setdefault(id(t), alias if alias is not None else vid)
            if t._is_view():
                self.root_of.setdefault(id(t._base), alias if alias is not None else vid)
            self.new.append(value)
            outs.append(Ref(vid))
        self.ops.append(Op(op_id, target, tuple(args), tuple(kwargs), tuple(r.id for r in outs), (), (), source))
        return outs


def _ref(vid: int | None) -> Ref | None:
    return None if vid is None else Ref(vid)
