"""The attention pattern: an exported nn.MultiheadAttention block, found by its module metadata, is
lowered whole, as the ops of its inference fast path (the ops a trace records), so both frontends
give the same op graph. Any block that differs lowers op by op."""

from __future__ import annotations

import torch

from .schema import schema_order

_MOVES = {"aten::transpose", "aten::unflatten", "aten::unsqueeze", "aten::squeeze", "aten::contiguous", "aten::select",
          "aten::view", "aten::reshape", "aten::permute", "aten::_unsafe_view", "aten::clone", "aten::split",
          "aten::chunk", "aten::unbind", "aten::expand"}
_MULTI_HEAD_ATTENTION = "torch.nn.modules.activation.MultiheadAttention"


def attention_blocks(graph, kinds, state) -> tuple[dict, set]:
    """nn.MultiheadAttention (batch_first self-attention, packed projection, no mask, no attention
    weights) as exported: torch.export records its general path, about 25 view, copy and select
    ops around the projections and scaled dot-product attention. Returns {last node: (input,
    embed, heads, in-projection weight and bias, out-projection weight and bias)} and the other
    nodes of each such block, so the block lowers as the fast path's ops, the same ops a trace
    records (`GraphBuilder.multi_head_attention`). A block that differs in any way lowers op by op."""
    blocks: dict[str, list] = {}
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack") or {} if node.op == "call_function" else {}
        for key, (_, kind) in stack.items():
            kind = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
            if kind == _MULTI_HEAD_ATTENTION:
                blocks.setdefault(key, []).append(node)
                break
    attention, inside = {}, set()
    for nodes in blocks.values():
        found = _attention_block(nodes, kinds, state)
        if found is not None:
            attention[nodes[-1]] = found
            inside.update(nodes[:-1])
    return attention, inside


def _attention_block(nodes: list, kinds, state):
    def param(arg):
        ok = isinstance(arg, torch.fx.Node) and arg.op == "placeholder" and arg.name in kinds
        value = state.get(kinds[arg.name].target) if ok else None
        return value if isinstance(value, torch.Tensor) and value.dim() in (1, 2) else None

    members = set(nodes)
    names = [getattr(getattr(n.target, "_schema", None), "name", None) for n in nodes]
    if names.count("aten::linear") != 2 or names.count("aten::scaled_dot_product_attention") != 1 \
            or any(n not in _MOVES for n in names if n not in ("aten::linear", "aten::scaled_dot_product_attention")):
        return None
    first, last = nodes[0], nodes[-1]
    outside = [u for n in nodes for u in n.users if u not in members]
    feeds = {a for n in nodes for a in n.all_input_nodes if a not in members and a.op != "placeholder"
             or (a.op == "placeholder" and param(a) is None)}
    if any(u for n in nodes[:-1] for u in n.users if u not in members) or not outside or feeds != {first.args[0]}:
        return None
    if names[0] != "aten::transpose" or sorted(first.args[1:3]) != [0, 1] or names[-1] != "aten::transpose" \
            or sorted(last.args[1:3]) != [0, 1] or len(first.users) != 1:  # batch first: in and out transposed
        return None
    projections = [n for n, name in zip(nodes, names) if name == "aten::linear"]
    attend = nodes[names.index("aten::scaled_dot_product_attention")]
    (proj_in, proj_out), x = projections, first.args[0]
    if next(iter(first.users)) is not proj_in or len(proj_in.args) < 3 or len(proj_out.args) < 3:
        return None
    w, b, proj_w, proj_b = proj_in.args[1], proj_in.args[2], proj_out.args[1], proj_out.args[2]
    tensors = [param(a) for a in (w, b, proj_w, proj_b)]
    val = x.meta.get("val")
    if any(t is None for t in tensors) or not isinstance(val, torch.Tensor) or val.dim() != 3:
        return None
    embed = val.shape[-1]
    out = attend.meta.get("val")
    _, _, _, mask, dropout, causal, *rest = schema_order(attend.target._schema, list(attend.args), dict(attend.kwargs))
    if tuple(tensors[0].shape) != (3 * embed, embed) or tuple(tensors[2].shape) != (embed, embed) \
            or not isinstance(out, torch.Tensor) or out.dim() != 4 or mask is not None or dropout != 0 or causal \
            or any(r not in (None, False) for r in rest):
        return None  # separate q/k/v weights, a mask, dropout, causal attention or a scale: op by op
    return x, int(embed), int(out.shape[1]), w, b, proj_w, proj_b
