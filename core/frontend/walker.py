"""The TorchScript frontend's interpreter: one walk over an inlined TorchScript graph, node by
node, emitting its device ops through its `GraphBuilder` (`Walker.builder`), whose public methods
are all it uses.

Host-side nodes (constants, lists, tuples, sizes, ints, `prim::If` on known conditions, loops
with known trip counts) are evaluated on the spot; every other node is a device op.
"""

from __future__ import annotations

import os
import re

import torch

from ..errors import NimbleError, ShapeError, UnsupportedError, UsageError, first_line
from ..ir import Ref, TensorSpec
from ..ops import attention, targets
from ..ops.allowlist import METADATA_OPS, NONDETERMINISTIC
from ..ops.arguments import call_schema
from .builder import IDENTITY_WHEN_NOT_TRAINING, TORCH_FILE, GraphBuilder, flat
from .hostops import host_op

_MAX_UNROLL = 100_000
_FRAME = re.compile(r'File "([^"]+)", line (\d+)|^(.+?)\((\d+)\): ', re.M)
# Targets rewritten to an equivalent canonical op: (new target, number of leading args kept).
# _convolution's extra flags only pick cuDNN settings; convolution reads the same from globals.
_CANONICAL = {"aten::_convolution.default": ("aten::convolution.default", 9)}
_SCHEMAS: dict[str, tuple] = {}  # a node's schema text -> (parsed schema, target): a model repeats few




def source_of(node: torch._C.Node) -> str:
    """'file.py:12' of the model code behind a node: the first frame outside torch itself."""
    return _first_model_frame(node.sourceRange())


def _first_model_frame(text: str) -> str:
    """Frames are read lazily: the model's own frame usually comes within the first few."""
    first = None
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    for m in _FRAME.finditer(text):  # both script and trace frame formats, in order
        file, line = m.group(1) or m.group(3), m.group(2) or m.group(4)
        first = first or f"{file}:{line}"
        if not (file.startswith(torch_dir) or TORCH_FILE.search(file) or file.startswith("code/")):
            return f"{file}:{line}"
    return first or "<unknown source>"


class ModuleAttr:
    """A submodule reached through `prim::GetAttr`, with its qualified name ('layer1.0.')."""

    def __init__(self, module: torch._C.ScriptModule, prefix: str = ""):
        self.module, self.prefix = module, prefix


class Walker:
    """One pass over a TorchScript graph, building IR values and ops as it goes.

    For inference the graph is frozen (`torchscript.frozen_graph`): weights are constants, and
    an attribute read that remains is a host value like any other. With `training=True` it is
    not: parameters and buffers are read through `prim::GetAttr` and become weights named by their
    qualified names ('layer1.0.bn1.running_mean'), random ops stay device ops, and training-mode
    batch norm counts as writing its running statistics."""

    def __init__(self, name: str, training: bool = False):
        self.name = name
        self.builder = GraphBuilder(name, training)  # the one way ops are emitted
        self.attrs: dict[str, torch.Tensor] = {}  # qualified name -> the module's tensor
        self.attr_ids: set[int] = set()  # ids of those tensors: device values, never folded
        self.env: dict[int, object] = {}  # jit value unique() -> Ref or host object

    def bind_module(self, graph: torch._C.Graph, module: torch.jit.ScriptModule) -> None:
        """Let `prim::GetAttr` on the graph's `self` input read `module`'s attributes."""
        self.env[next(graph.inputs()).unique()] = ModuleAttr(module._c)

    def _get_attr(self, owner, name: str, node):
        if not isinstance(owner, ModuleAttr):
            raise UnsupportedError(f"{self.name}: prim::GetAttr on a {type(owner).__name__} at "
                                   f"{source_of(node)}; nimble reads attributes of modules only")
        value = owner.module.getattr(name)
        qualified = owner.prefix + name
        if isinstance(value, torch._C.ScriptModule):
            return ModuleAttr(value, qualified + ".")
        if isinstance(value, torch.Tensor):
            if qualified not in self.attrs:  # one tensor object per attribute, so one weight value
                self.attrs[qualified] = value
                if self.builder.training:  # a device value, never folded; in inference, a constant
                    self.attr_ids.add(id(value))
                self.builder.name_constant(value, qualified)
            return self.attrs[qualified]
        return value

    def bind_inputs(self, graph: torch._C.Graph, specs: list[TensorSpec]) -> None:
        params = list(graph.inputs())[1:]  # inputs()[0] is the module itself
        names = [p.debugName().split(".")[0] for p in params]
        if len(specs) != len(params):
            raise UsageError(f"{self.name} takes {len(params)} input(s) ({', '.join(names)}) "
                             f"but {len(specs)} shape(s) were given; pass one --shape per input")
        for param, name, spec in zip(params, names, specs):
            if not param.type().isSubtypeOf(torch._C.TensorType.get()):
                raise UnsupportedError(f"{self.name} input '{name}' is a {param.type()}, not a "
                                       "Tensor; nimble takes models whose inputs are all tensors")
            self.env[param.unique()] = self.builder.add_input(name, spec)

    def block(self, block) -> None:
        for node in block.nodes():
            try:
                self.node(node)
            except NimbleError:
                raise
            except Exception as e:
                raise UnsupportedError(f"{self.name}: could not lower {node.kind()} at "
                                       f"{source_of(node)}: {first_line(e)}") from e

    def _get(self, v):
        return self.env[v.unique()]

    def node(self, node) -> None:
        kind = node.kind()
        outs = list(node.outputs())
        ins = [self._get(v) for v in node.inputs()]
        if kind == "prim::Constant":
            value = outs[0].toIValue() if outs[0].type().kind() != "NoneType" else None
            if isinstance(value, torch.Tensor):
                self.builder.name_constant(value, outs[0].debugName())
            self.env[outs[0].unique()] = value
        elif kind == "prim::ListConstruct":
            self.env[outs[0].unique()] = list(ins)
        elif kind == "prim::TupleConstruct":
            self.env[outs[0].unique()] = tuple(ins)
        elif kind == "prim::DictConstruct":  # keys and values alternate, as segmentation models return
            self.env[outs[0].unique()] = dict(zip(ins[0::2], ins[1::2]))
        elif kind in ("prim::ListUnpack", "prim::TupleUnpack"):
            if len(ins[0]) != len(outs):
                raise ShapeError(f"{self.name}: unpacking {len(ins[0])} values into {len(outs)} "
                                 f"at {source_of(node)}")
            for o, v in zip(outs, ins[0]):
                self.env[o.unique()] = v
        elif kind == "prim::TupleIndex":
            self.env[outs[0].unique()] = ins[0][ins[1]]
        elif kind in ("prim::unchecked_cast", "aten::detach", "prim::data"):
            self.env[outs[0].unique()] = ins[0]
        elif kind == "prim::Uninitialized":
            self.env[outs[0].unique()] = None
        elif kind in ("aten::warn", "prim::Print"):
            pass
        elif kind == "prim::RaiseException":
            raise UnsupportedError(f"{self.name} raises an exception at {source_of(node)} for these "
                                   f"input shapes: {ins[0] if ins else ''}")
        elif kind == "prim::NumToTensor":
            self.env[outs[0].unique()] = torch.tensor(ins[0])
        elif kind == "prim::dtype":
            self.env[outs[0].unique()] = self.builder.tensor_of(ins[0]).dtype
        elif kind == "prim::device":
            self.env[outs[0].unique()] = torch.device("cpu")  # any device argument means "the run's"
        elif kind == "prim::If":
            self._if(node, ins[0])
        elif kind == "prim::Loop":
            self._loop(node, ins)
        elif kind == "prim::GetAttr":
            self.env[outs[0].unique()] = self._get_attr(ins[0], node.s("name"), node)
        elif kind in ("prim::CallMethod", "prim::CallFunction", "prim::PythonOp"):
            raise UnsupportedError(f"{self.name}: {kind} survived inlining at {source_of(node)}; "
                                   "nimble needs a module whose forward inlines to plain ops")
        else:
            self._schema_node(node, ins, outs)

    def _condition(self, value, node) -> bool:
        if isinstance(value, Ref):
            self._data_dependent(node)
        return bool(value)

    def _data_dependent(self, node):
        raise UnsupportedError(
            f"{self.name}: {node.kind()} at {source_of(node)} depends on tensor values; nimble needs "
            "control flow and shapes fixed by the input shapes alone")

    def _if(self, node, cond) -> None:
        taken = list(node.blocks())[0 if self._condition(cond, node) else 1]
        self.block(taken)
        for o, r in zip(node.outputs(), taken.returnNode().inputs()):
            self.env[o.unique()] = self._get(r)

    def _loop(self, node, ins) -> None:
        trips, cond, carried = ins[0], ins[1], list(ins[2:])
        body = list(node.blocks())[0]
        params = list(body.inputs())
        i = 0
        while self._condition(cond, node) and i < trips:
            if i >= _MAX_UNROLL:
                raise UnsupportedError(f"{self.name}: loop at {source_of(node)} runs over "
                                       f"{_MAX_UNROLL} iterations; nimble unrolls loops")
            self.env[params[0].unique()] = i
            for p, v in zip(params[1:], carried):
                self.env[p.unique()] = v
            self.block(body)
            results = [self._get(r) for r in body.returnNode().inputs()]
            cond, carried, i = results[0], results[1:], i + 1
        for o, v in zip(node.outputs(), carried):
            self.env[o.unique()] = v

    def _schema_node(self, node, ins, outs) -> None:
        source = source_of(node)
        text = node.schema()
        parsed = _SCHEMAS.get(text)
        if parsed is None:
            try:
                schema = torch._C.parse_schema(text)
            except RuntimeError:
                raise UnsupportedError(f"{self.name}: op {node.kind()} at {source} is not supported "
                                       "(it has no aten schema)") from None
            parsed = _SCHEMAS[text] = (schema, targets.target_of(schema))
        schema, target = parsed
        refs = any(isinstance(a, Ref) or id(a) in self.attr_ids for a in flat(ins))
        tensor_out = any(_is_tensor_type(o.type()) for o in outs)
        short = target.split("::")[1].split(".")[0]
        self.builder.check_reads(schema, target, ins, source)
        if not refs and not (self.builder.training and short in NONDETERMINISTIC):
            python = host_op(schema.name) if not tensor_out else None
            self._bind_host(outs, python(*ins) if python else self.builder.fold(schema, target, ins, source))
        elif schema.name == "aten::_shape_as_tensor":  # a traced x.shape: static here, so a host tensor
            shape = self.builder.meta[ins[0].id].shape if isinstance(ins[0], Ref) else ins[0].shape
            self._bind_host(outs, torch.tensor(shape, dtype=torch.long))
        elif not tensor_out:
            if schema.name not in METADATA_OPS:
                self._data_dependent(node)
            args = [self.builder.tensor_of(a) if isinstance(a, Ref) else a for a in ins]
            python = host_op(schema.name)
            self._bind_host(outs, python(*args) if python else call_schema(schema, target, args))
        elif schema.name in IDENTITY_WHEN_NOT_TRAINING and ins[2] is False:
            self.env[outs[0].unique()] = ins[0]
        elif target == "aten::_native_multi_head_attention.default":
            self._bind_host(outs, native_attention(self.builder, ins, source))
        else:
            if target in _CANONICAL:
                target, keep = _CANONICAL[target]
                schema, ins = targets.resolve(target)._schema, ins[:keep]
            self._device_op(node, schema, target, ins, outs, source)

    def _bind_host(self, outs, result) -> None:
        if len(outs) == 1:
            self.env[outs[0].unique()] = result
        else:
            for o, r in zip(outs, result):
                self.env[o.unique()] = r

    def _device_op(self, node, schema, target, ins, outs, source) -> None:
        result = self.builder.emit(schema, target, ins, source)
        listed = len(outs) == 1 and outs[0].type().kind() == "ListType"  # Tensor[] (split, chunk, unbind)
        if isinstance(result, Ref):  # one result, or a split that hands back its input
            self.env[outs[0].unique()] = [result] if listed else result
        elif listed:  # even of one piece (unbind of a size-1 dimension)
            self.env[outs[0].unique()] = result
        else:
            self._bind_host(outs, result if len(outs) > 1 else result[0])

    def graph_outputs(self, graph) -> list[int]:
        out = []
        for obj in flat([self._get(v) for v in graph.outputs()]):
            if isinstance(obj, torch.Tensor):
                obj = self.builder.as_ref(obj)
            if not isinstance(obj, Ref):
                raise UnsupportedError(f"{self.name} returns a {type(obj).__name__}; nimble needs "
                                       "models that return tensors (or tuples, lists and dicts of them)")
            out.append(obj.id)
        return out


def _is_tensor_type(t) -> bool:
    tensor = torch._C.TensorType.get()
    if t.isSubtypeOf(tensor):
        return True
    return any(_is_tensor_type(c) for c in t.containedTypes())


def native_attention(builder: GraphBuilder, ins: list, source: str):
    """`aten::_native_multi_head_attention`, nn.MultiheadAttention's inference fast path (what a
    trace of it records, in torchvision's ViT say), as the ops it stands for: the input
    projections, then `ops.attention.attend`. Without attention weights or a mask only."""
    query, key, value, embed, heads, w, b, proj_w, proj_b, mask, need_weights = ins[:11]
    if mask is not None or need_weights:
        raise UnsupportedError(f"{builder.name}: nn.MultiheadAttention at {source} with an attention mask or "
                               "need_weights=True; nimble lowers it without either")
    if not isinstance(w, torch.Tensor) or (b is not None and not isinstance(b, torch.Tensor)):
        raise UnsupportedError(f"{builder.name}: nn.MultiheadAttention at {source} with computed weights")
    if query is key is value:  # self-attention: one projection, split three ways
        q, k, v = builder.emit(targets.resolve(attention.SPLIT)._schema, attention.SPLIT,
                               [builder.op(attention.LINEAR, [query, w, b], source), embed, -1], source)
    else:
        q, k, v = (builder.op(attention.LINEAR, [x, w[i * embed:(i + 1) * embed],
                                                 None if b is None else b[i * embed:(i + 1) * embed]], source)
                   for i, x in enumerate((query, key, value)))
    batch, length = builder.tensor_of(q).shape[:2]
    return attention.attend(lambda target, args: builder.op(target, args, source), q, k, v, batch, length, embed,
                            heads, lambda x: builder.tensor_of(x).shape[1], proj_w, proj_b), None
