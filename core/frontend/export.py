"""torch.export archive (`.pt2`: an ExportedProgram saved with `torch.export.save`) + input specs
-> IR `Graph` plus its weights, through the same builder as TorchScript (`GraphBuilder.emit`).

The program's graph is lowered as exported, in its default op set, which keeps convolution,
linear and batch norm whole, and in-place ops as they are. Parameters, buffers and lifted
constants are host tensors, so ops on them alone fold on the host, as under freezing. What
freezing does beyond that (batch-norm folding, functionalisation, concatenation flattening) is
left to the passes (`passes/`). Input shapes and dtypes come from the program's example inputs;
specs are needed only for dimensions the program left dynamic. Reading the archive is
`program.py`'s job.
"""

from __future__ import annotations

import math
import operator
import os
import re

import torch

from ..errors import NimbleError, ShapeError, UnsupportedError, UsageError, first_line
from ..ir import Ref, TensorSpec
from ..ops import targets, types
from ..ops.allowlist import NONDETERMINISTIC
from .builder import FOLD_LIMIT, IDENTITY_WHEN_NOT_TRAINING, TORCH_FILE, GraphBuilder, refs_in, short_name
from .finalize import finalize
from .schema import schema_order
from .torchscript import Lowered

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def program_inputs(program: torch.export.ExportedProgram) -> list[tuple[str, tuple, torch.dtype]]:
    """(name, shape, dtype) of each user input; a dynamic dimension is None in its shape."""
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    out = []
    for spec in program.graph_signature.input_specs:
        if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT:
            continue
        val = nodes[spec.arg.name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise UnsupportedError(f"input '{spec.arg.name}' is a {type(val).__name__}, not a tensor; "
                                   "nimble takes models whose inputs are all tensors")
        shape = tuple(d if isinstance(d, int) else None for d in val.shape)
        out.append((spec.arg.name, shape, val.dtype))
    return out


def input_specs_for(program: torch.export.ExportedProgram, given: list[TensorSpec] | None,
                    name: str) -> list[TensorSpec]:
    """The program's own input specs, or `given` checked against them (needed for dynamic dims)."""
    inputs = program_inputs(program)
    if given is None:
        dynamic = [(n, i) for n, shape, _ in inputs for i, d in enumerate(shape) if d is None]
        if dynamic:
            n, i = dynamic[0]
            raise UsageError(f"{name}: dimension {i} of input '{n}' is dynamic in the program; give every "
                             "input a static shape with --shape")
        return [TensorSpec(shape, types.dtype_name(dtype)) for _, shape, dtype in inputs]
    if len(given) != len(inputs):
        raise UsageError(f"{name} takes {len(inputs)} input(s) ({', '.join(n for n, _, _ in inputs)}) but "
                         f"{len(given)} shape(s) were given; pass one --shape per input, or none")
    ranges = _dynamic_ranges(program)
    specs = []
    for k, ((n, shape, dtype), spec) in enumerate(zip(inputs, given)):
        for dim, size in enumerate(spec.shape):
            low, high = ranges.get((k, dim), (None, None))
            if (low is not None and size < low) or (high is not None and size > high):
                raise ShapeError(f"{name}: dimension {dim} of input '{n}' was exported for sizes {low} to {high}, "
                                 f"not {size}; export it again with a wider torch.export.Dim (max={size} or more)")
        fixed = len(spec.shape) == len(shape) and all(d is None or d == g for d, g in zip(shape, spec.shape))
        if not fixed:
            want = "x".join("?" if d is None else str(d) for d in shape) or "scalar"
            raise ShapeError(f"{name}: input '{n}' was exported as {want}, not "
                             f"{'x'.join(map(str, spec.shape)) or 'scalar'}; a program only takes other sizes "
                             "for the dimensions it exported as dynamic")
        program_dtype = types.dtype_name(dtype)
        if spec.dtype not in (program_dtype, "float32"):  # float32 is --dtype's default
            raise ShapeError(f"{name}: input '{n}' is {program_dtype} in the program, not {spec.dtype}")
        specs.append(TensorSpec(spec.shape, program_dtype))
    return specs


def _dynamic_ranges(program: torch.export.ExportedProgram) -> dict[tuple[int, int], tuple[int | None, int | None]]:
    """(user input, dimension) -> the (low, high) sizes the program was exported for, for each
    dynamic dimension whose range the program records (None: unbounded)."""
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    user = [s for s in program.graph_signature.input_specs
            if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    found = {}
    for k, spec in enumerate(user):
        val = nodes[spec.arg.name].meta.get("val")
        for dim, d in enumerate(getattr(val, "shape", ())):
            expr = getattr(getattr(d, "node", None), "expr", None)
            bound = program.range_constraints.get(expr) if expr is not None else None
            if bound is None:
                continue
            try:
                low, high = bound.lower, bound.upper
                found[(k, dim)] = (int(low) if getattr(low, "is_finite", True) and low is not None else None,
                                   int(high) if getattr(high, "is_finite", False) else None)
            except (TypeError, ValueError, OverflowError):  # a range that is no pair of sizes: none kept
                continue
    return found


def lower_program(program: torch.export.ExportedProgram, inputs: list[TensorSpec] | None,
                  name: str = "model") -> Lowered:
    """Lower an ExportedProgram's graph for these input specs (None: the program's own)."""
    specs = input_specs_for(program, inputs, name)
    with torch.no_grad():
        graph, weights = _Lowering(program, name).run(specs)
    return Lowered(graph, weights, reference_of(program))


def output_names(program: torch.export.ExportedProgram) -> list[str]:
    """The names the model gives its outputs, from the structure its forward returns: a dict's
    keys (a Hugging Face output's fields), joined by dots where nested (`hidden.0`); `output` for
    a lone tensor, `output_0`, `output_1`... for a tuple. Where that structure cannot be read,
    `output_k` for each."""
    from torch.utils import _pytree as pytree

    count = sum(1 for s in program.graph_signature.output_specs
                if s.kind == torch.export.graph_signature.OutputKind.USER_OUTPUT)
    try:
        spec = program.call_spec.out_spec
        tree = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
        paths = [path for path, _ in pytree.tree_flatten_with_path(tree)[0]]
    except Exception:  # a structure of a type this process cannot import
        paths = None
    if paths is None or len(paths) != count:
        return [f"output_{k}" for k in range(count)]
    if paths == [()]:
        return ["output"]
    names = []
    for path in paths:
        parts = [str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))) for key in path]
        names.append("_".join(["output", *parts]) if hasattr(path[0], "idx") else ".".join(parts))
    return names


def reference_of(program: torch.export.ExportedProgram):
    """The program as a function of its user inputs, for reference outputs: its graph module with
    the lifted parameters, buffers and constants passed in (`ExportedProgram.module()` can fail to
    re-attach them after a reload)."""
    state = {**program.state_dict, **program.constants}
    specs = program.graph_signature.input_specs
    user = torch.export.graph_signature.InputKind.USER_INPUT

    def run(*inputs):
        given = iter(inputs)
        args = [next(given) if s.kind == user else state[s.target] for s in specs]
        return program.graph_module(*args)

    return run


class _Lowering:
    def __init__(self, program: torch.export.ExportedProgram, name: str):
        self.program, self.name = program, name
        state = [t for t in (*program.state_dict.values(), *program.constants.values()) if isinstance(t, torch.Tensor)]
        limit = max(FOLD_LIMIT, sum(t.numel() * t.element_size() for t in state))  # a fold may copy every weight
        self.builder = GraphBuilder(name, training=False, strict_folding=True, fold_limit=limit, views_may_copy=True)
        self.env: dict[torch.fx.Node, object] = {}

    def run(self, specs: list[TensorSpec]):
        sig = self.program.graph_signature
        kinds = {s.arg.name: s for s in sig.input_specs}
        state = {**self.program.state_dict, **self.program.constants}
        user = iter(specs)
        w = self.builder
        for node in self.program.graph.nodes:
            try:
                if node.op == "placeholder":
                    self.env[node] = self._placeholder(node, kinds[node.name], user, state)
                elif node.op == "call_function":
                    self.env[node] = self._call(node)
                elif node.op == "output":
                    outputs = self._outputs(node)
                else:
                    raise UnsupportedError(f"{self.name}: graph node {node.op} '{node.name}' is not supported")
            except NimbleError:
                raise
            except Exception as e:
                raise UnsupportedError(f"{self.name}: could not lower {node.target} at {_source(node)}: "
                                       f"{first_line(e)}") from e
        return finalize(w.values, w.ops, w.inputs, outputs, w.weights)

    def _placeholder(self, node, spec, user, state):
        """A user input becomes a graph input; parameters, buffers and constants are host tensors."""
        if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT:
            return self.builder.add_input(node.name, next(user))
        if spec.target in state and isinstance(state[spec.target], torch.Tensor):
            tensor = state[spec.target].detach()
            self.builder.name_constant(tensor, spec.target)
            return tensor
        raise UnsupportedError(f"{self.name}: input '{node.name}' is a {spec.kind.name.lower()}, which nimble "
                               "does not take")

    def _value(self, arg):
        if isinstance(arg, torch.fx.Node):
            return self.env[arg]
        if isinstance(arg, tuple):
            return tuple(self._value(a) for a in arg)
        if isinstance(arg, list):
            return [self._value(a) for a in arg]
        return arg

    def _call(self, node):
        if node.target is operator.getitem:
            return self._value(node.args[0])[node.args[1]]
        if node.target in _SIZE_ARITHMETIC:  # export's arithmetic on sizes: plain numbers here
            return size_arithmetic(node.target, [self._value(a) for a in node.args],
                                   f"{self.name}: {getattr(node.target, '__name__', node.target)} at {_source(node)}")
        if not isinstance(node.target, torch._ops.OpOverload):
            raise UnsupportedError(f"{self.name}: {getattr(node.target, '__name__', node.target)} at {_source(node)} "
                                   "is not an aten op; nimble needs a program whose graph holds aten ops only")
        schema = node.target._schema
        target = targets.target_of(schema)
        ins = schema_order(schema, [self._value(a) for a in node.args],
                            {k: self._value(v) for k, v in node.kwargs.items()})
        if schema.name == "aten::_assert_tensor_metadata":  # export's dtype guard: static here, so check it now
            x, dtype = ins[0], dict(zip((a.name for a in schema.arguments), ins)).get("dtype")
            actual = self.builder.tensor_of(x).dtype if isinstance(x, (Ref, torch.Tensor)) else None
            if dtype is not None and actual is not None and actual != dtype:
                raise ShapeError(f"{self.name}: at {_source(node)} the program expects {dtype}, not {actual}")
            return None
        if schema.name in _SIZES:  # a dimension of a tensor of known shape: a number
            return _SIZES[schema.name](self.builder.tensor_of(ins[0]), *ins[1:])
        if schema.name in _SIZE_CHECKS:  # export's guards on sizes: decided here, for these shapes
            return self._size_check(schema.name, ins, node)
        if schema.name in IDENTITY_WHEN_NOT_TRAINING and ins[2] is False:
            return ins[0]
        self.builder.check_reads(schema, target, ins, _source(node))
        # weights and constants alone: fold on the host, as freezing does; but a training step's
        # random ops (and the torch.empty a stochastic depth fills) are ops of every call
        if not refs_in(ins) and not (self.builder.training and short_name(target) in NONDETERMINISTIC):
            return self.builder.fold(schema, target, ins, _source(node))
        result = self.builder.emit(schema, target, ins, _source(node))
        if not isinstance(result, list):  # the op hands back its input (a split into one piece, say)
            return [result] if _returns_list(schema) else result
        if len(schema.returns) == 1 and not _returns_list(schema):
            return result[0]
        return result if len(schema.returns) == 1 else tuple(result)

    def _size_check(self, name: str, ins: list, node) -> None:
        if name == "aten::_assert_scalar":
            if not isinstance(ins[0], (bool, int)):
                raise UnsupportedError(f"{self.name}: the program asserts on a tensor's value at {_source(node)}")
            if not ins[0]:
                raise ShapeError(f"{self.name}: these input shapes fail the program's own check at {_source(node)} "
                                 f"({str(ins[1])[:200]}); export it for these sizes")
            return None
        value, low, high = ins[0], ins[1], ins[2]  # sym_constrain_range(_for_size)
        if isinstance(value, int) and ((low is not None and value < low) or (high is not None and value > high)):
            raise ShapeError(f"{self.name}: a size of {value} is outside the range {low} to {high} the program was "
                             f"exported for, at {_source(node)}")
        return None

    def _outputs(self, node) -> list[int]:
        kinds = [s.kind for s in self.program.graph_signature.output_specs]
        if any(k != torch.export.graph_signature.OutputKind.USER_OUTPUT for k in kinds):
            raise UnsupportedError(f"{self.name}: the program writes its buffers or inputs in place; nimble "
                                   "takes programs exported in eval mode that only return results")
        return self._output_ids(node)

    def _output_ids(self, node) -> list[int]:
        """The value id of each tensor the program returns (a host tensor becomes a weight)."""
        out = []
        for obj in _leaves(self._value(node.args[0])):
            if isinstance(obj, torch.Tensor):
                obj = self.builder.as_ref(obj)
            if not hasattr(obj, "id"):
                raise UnsupportedError(f"{self.name} returns a {type(obj).__name__}; nimble needs programs "
                                       "that return tensors")
            out.append(obj.id)
        return out

# export's shape guards, evaluated on the shapes being compiled (a graph exported with a dynamic
# dimension asks for its size, computes on it, and asserts on it)
_SIZES = {
    "aten::sym_size": lambda t, dim: int(t.shape[dim]),
    "aten::sym_numel": lambda t: int(t.numel()),
    "aten::sym_stride": lambda t, dim: int(t.stride()[dim]),
    "aten::sym_storage_offset": lambda t: 0,
}
_SIZE_CHECKS = {"aten::_assert_scalar", "aten::sym_constrain_range", "aten::sym_constrain_range_for_size"}
_SIZE_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod,
                    operator.pow, operator.neg, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
                    operator.ge, operator.and_, operator.or_, operator.not_, torch.sym_int, torch.sym_float,
                    torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_ite, math.ceil, math.floor, math.trunc}


SIZE_LIMIT = 2**62  # a size computation beyond this comes from a crafted program, not a model


def size_arithmetic(target, args: list, where: str):
    """`target(*args)` on plain numbers, refused in one line where an argument is a tensor or the
    work or its result would be out of any size's range (a crafted program's `2 ** 10**9`)."""
    if not all(isinstance(a, (int, float, bool)) for a in args):
        raise UnsupportedError(f"{where} computes on a tensor's values, not on sizes")
    if any(abs(a) > SIZE_LIMIT for a in args) or (target is operator.pow and len(args) == 2 and abs(args[1]) > 64):
        raise UnsupportedError(f"{where} computes a number out of any size's range; the program is not one torch.export "
                               "wrote for a model")
    return target(*args)


def _returns_list(schema) -> bool:
    """The op returns Tensor[] (split, chunk, unbind), whatever its alias annotation."""
    return len(schema.returns) == 1 and isinstance(schema.returns[0].type, torch.ListType)


def _leaves(obj):
    if isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _leaves(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _leaves(o)
    else:
        yield obj


def _source(node) -> str:
    """'file.py:12' of the model code behind a node: the innermost frame outside torch."""
    trace = node.meta.get("stack_trace") or ""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    frames = _FRAME.findall(trace)
    for file, line in reversed(frames):
        if not file.startswith(torch_dir) and not TORCH_FILE.search(file):
            return f"{file}:{line}"
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else f"<graph node {node.name}>"
