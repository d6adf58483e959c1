"""torch.export archive (`.pt2`: an ExportedProgram saved with `torch.export.save`) + input specs
-> IR `Graph` plus its weights, through the same walker as TorchScript (`Walker.emit`).

The program's graph is lowered as exported, in its default op set, which keeps convolution,
linear and batch norm whole. Parameters, buffers and lifted constants are host tensors, so ops on
them alone fold on the host, as under freezing; a convolution whose only reader is an inference
batch norm gets the norm folded into its weight and bias, as `torch.jit.freeze` does (named
`<conv>.weight_fused_bn`, `<conv>.bias_fused_bn`). Input shapes and dtypes come from the
program's example inputs; specs are needed only for dimensions the program left dynamic.

Loading: torch's archive reader can run code that a crafted archive carries (pickled constants,
size expressions it evaluates). `load_program` first checks the archive's members
(`archive.check_archive`), then lets torch read it with its unrestricted unpicklers unreachable
(`archive.unpicklers_blocked`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import operator
import os
import re
import typing
import zipfile
from pathlib import Path

import torch

from ..errors import ModelError, NimbleError, ShapeError, UnsupportedError, first_line
from ..ir import ACTIVATION, Ref, TensorSpec
from ..ops import targets, types
from .archive import check_archive, unpicklers_blocked
from .finalize import finalize
from .torchscript import Lowered
from .walker import _IDENTITY_WHEN_NOT_TRAINING, _TORCH_FILE, FOLD_LIMIT, SharedWrite, Walker, _refs_of

HINT = "save it with torch.export.save(torch.export.export(model, example_inputs), path)"
_CONVOLUTIONS = {"aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::convolution"}
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def is_program(path: str | os.PathLike) -> bool:
    """A zip that holds an exported program (the PT2 archive of torch.export.save)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("archive_format") or n.endswith("serialized_exported_program.json")
                       for n in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


@contextlib.contextmanager
def _cached_type_hints():
    """torch's archive reader asks typing.get_type_hints about the same few schema dataclasses once
    per serialized object: 11,000 times and 1.1 s of a 2.5 s load for vit_b_32. While it reads,
    each answer is computed once (and handed out as a copy)."""
    original, cache = typing.get_type_hints, {}

    def cached(obj, globalns=None, localns=None, include_extras=False):
        key = (obj, id(globalns), id(localns), include_extras)
        try:
            hints = cache.get(key)
        except TypeError:  # an unhashable object
            return original(obj, globalns, localns, include_extras)
        if hints is None:
            hints = cache[key] = original(obj, globalns, localns, include_extras)
        return dict(hints)

    typing.get_type_hints = cached
    try:
        yield
    finally:
        typing.get_type_hints = original


def load_program(path: str | os.PathLike) -> torch.export.ExportedProgram:
    """Load a `.pt2` archive on the CPU; one-line ModelError on any defect. A program whose outputs
    are a library's dataclass (a Hugging Face ModelOutput) loads once that library registered the
    class with torch's pytree: nimble imports it, for the libraries in OUTPUT_LIBRARIES only."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: {'not a file' if path.exists() else 'no such file'}; pass a program saved "
                         "with torch.export.save")
    if not is_program(path):
        raise ModelError(f"{path} is not a torch.export archive; {HINT}")
    check_archive(path)
    for attempt in range(2):
        try:
            with unpicklers_blocked(), _cached_type_hints(), _logged_errors() as logged:
                return torch.export.load(str(path))
        except Exception as e:  # a refused pickle, a malformed graph, an unknown op...
            cause = logged[-1] if logged else e  # torch logs the real error and raises a generic one
            if isinstance(cause, ModelError):  # an unpickler that was asked for
                raise ModelError(f"{path}: {cause}") from e
            if "Weights only load failed" in str(cause):
                raise ModelError(f"{path} holds a pickle with objects other than tensors; nimble refuses it, "
                                 f"since unpickling it could run code. {HINT}") from e
            unknown = _UNREGISTERED.search(str(cause))
            if unknown is None or attempt:
                raise ModelError(f"{path} could not be loaded as an exported program ({first_line(cause)}); "
                                 f"{HINT}") from e
            _import_output_library(path, unknown.group(1))


OUTPUT_LIBRARIES = ("transformers", "torchvision", "timm", "diffusers")  # imported to load their output types
# The modules of those libraries that define output types: importing one defines model classes
# and registers them, and runs nothing else (a library's command-line or hub modules are refused).
_OUTPUT_MODULES = re.compile(r"transformers\.modeling_outputs|transformers\.models\.\w+\.modeling_\w+"
                             r"|torchvision\.models(\.\w+)*|timm\.models(\.\w+)*|diffusers\.models(\.\w+)*"
                             r"|diffusers\.pipelines\.\w+\.pipeline_output")
_UNREGISTERED = re.compile(r"Deserializing ([\w.]+) in pytree is not registered")


def _import_output_library(path: Path, type_name: str) -> None:
    module = type_name.rpartition(".")[0]
    library = module.split(".")[0]
    if library not in OUTPUT_LIBRARIES:
        raise ModelError(f"{path} returns a {type_name}, a type torch cannot read back until its library "
                         f"registers it, and nimble imports only {', '.join(OUTPUT_LIBRARIES)}; export the "
                         "model returning tensors, or tuples, lists or dicts of them")
    if module != library and not _OUTPUT_MODULES.fullmatch(module):
        raise ModelError(f"{path} returns a {type_name}; nimble imports only the modules of {library} that define "
                         f"models and their outputs, not {module}; export the model returning tensors")
    try:
        importlib.import_module(module)
    except Exception as e:
        raise ModelError(f"{path} returns a {type_name}, and {module} could not be imported to read it "
                         f"({first_line(e)}); install {library}") from None


@contextlib.contextmanager
def _logged_errors():
    """The exceptions torch.export logs while it loads (with their tracebacks, on stderr), kept
    for the one-line error instead."""
    logger, caught = logging.getLogger("torch.export"), []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.exc_info and record.exc_info[1] is not None:
                caught.append(record.exc_info[1])

    handlers, propagate = logger.handlers, logger.propagate  # torch's own handler prints them
    logger.handlers, logger.propagate = [Keep()], False
    try:
        yield caught
    finally:
        logger.handlers, logger.propagate = handlers, propagate


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
            raise ShapeError(f"{name}: dimension {i} of input '{n}' is dynamic in the program; give every "
                             "input a static shape with --shape")
        return [TensorSpec(shape, types.dtype_name(dtype)) for _, shape, dtype in inputs]
    if len(given) != len(inputs):
        raise ShapeError(f"{name} takes {len(inputs)} input(s) ({', '.join(n for n, _, _ in inputs)}) but "
                         f"{len(given)} shape(s) were given; pass one --shape per input, or none")
    specs = []
    for (n, shape, dtype), spec in zip(inputs, given):
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


def lower_program(program: torch.export.ExportedProgram, inputs: list[TensorSpec] | None,
                  name: str = "model") -> Lowered:
    """Lower an ExportedProgram's graph for these input specs (None: the program's own)."""
    specs = input_specs_for(program, inputs, name)
    with torch.no_grad():
        try:
            graph, weights = _Lowering(program, name).run(specs)
        except SharedWrite:  # a value that stands for two ops is written in place: keep them apart
            graph, weights = _Lowering(program, name, cse=False).run(specs)
    return Lowered(graph, weights, _reference(program))


def _reference(program: torch.export.ExportedProgram):
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
    def __init__(self, program: torch.export.ExportedProgram, name: str, cse: bool = True):
        self.program, self.name = program, name
        state = [t for t in (*program.state_dict.values(), *program.constants.values()) if isinstance(t, torch.Tensor)]
        limit = max(FOLD_LIMIT, sum(t.numel() * t.element_size() for t in state))  # a fold may copy every weight
        self.walker = Walker(name, training=False, cse=cse, strict_folding=True, fold_limit=limit)
        self.env: dict[torch.fx.Node, object] = {}
        self.renamed: dict[int, Ref] = {}  # value written in place -> the functional op's result
        self.viewed: set[int] = set()  # values that have views, among the first `scanned` values
        self.scanned = 0

    def run(self, specs: list[TensorSpec]):
        sig = self.program.graph_signature
        kinds = {s.arg.name: s for s in sig.input_specs}
        state = {**self.program.state_dict, **self.program.constants}
        folds, skipped = self._conv_batch_norm_folds(kinds, state)
        self.absorbed = _nested_concats(self.program.graph)
        self.attention, self.inside = _attention_blocks(self.program.graph, kinds, state)
        user = iter(specs)
        w = self.walker
        for node in self.program.graph.nodes:
            try:
                if node.op == "placeholder":
                    spec = kinds[node.name]
                    if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT:
                        self.env[node] = w.add_input(node.name, next(user))
                    elif spec.target in state and isinstance(state[spec.target], torch.Tensor):
                        tensor = state[spec.target].detach()
                        w.hints[id(tensor)] = spec.target
                        w.hold.append(tensor)
                        self.env[node] = tensor
                    else:
                        raise UnsupportedError(f"{self.name}: input '{node.name}' is a {spec.kind.name.lower()}, "
                                               "which nimble does not take")
                elif node.op == "call_function":
                    self.env[node] = self._call(node, folds, skipped)
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

    def _value(self, arg):
        if isinstance(arg, torch.fx.Node):
            value = self.env[arg]
            return self.renamed.get(value.id, value) if isinstance(value, Ref) else value
        if isinstance(arg, tuple):
            return tuple(self._value(a) for a in arg)
        if isinstance(arg, list):
            return [self._value(a) for a in arg]
        return arg

    def _call(self, node, folds, skipped):
        if node.target is operator.getitem:
            return self._value(node.args[0])[node.args[1]]
        if not isinstance(node.target, torch._ops.OpOverload):
            raise UnsupportedError(f"{self.name}: {getattr(node.target, '__name__', node.target)} at {_source(node)} "
                                   "is not an aten op; nimble needs a program whose graph holds aten ops only")
        if node in skipped:  # a batch norm folded into the convolution before it
            return self.env[skipped[node]]
        if node in self.inside:  # inside an nn.MultiheadAttention lowered whole at its last node
            return None
        if node in self.attention:
            x, embed, heads, *weights = self.attention[node]
            x = self._value(x)
            ins = [x, x, x, embed, heads, *(self._value(a) for a in weights), None, False]
            return self.walker._multi_head_attention(ins, _source(node))[0]
        if node in self.absorbed:  # a concatenation that the one after it takes in whole
            return None
        if node.target is torch.ops.aten.cat.default and any(a in self.absorbed for a in node.args[0]):
            node = _flat_concat(node, self.absorbed)
        schema = node.target._schema
        target = targets.target_of(schema)
        ins = _schema_order(schema, [self._value(a) for a in node.args],
                            {k: self._value(v) for k, v in node.kwargs.items()})
        if node in folds:
            ins[1], ins[2] = folds[node]
        if schema.name == "aten::_assert_tensor_metadata":  # export's dtype guard: static here, so check it now
            x, dtype = ins[0], dict(zip((a.name for a in schema.arguments), ins)).get("dtype")
            actual = self.walker._tensor(x).dtype if isinstance(x, (Ref, torch.Tensor)) else None
            if dtype is not None and actual is not None and actual != dtype:
                raise ShapeError(f"{self.name}: at {_source(node)} the program expects {dtype}, not {actual}")
            return None
        if schema.name in _IDENTITY_WHEN_NOT_TRAINING and ins[2] is False:
            return ins[0]
        self.walker.check_reads(schema, target, ins, _source(node))
        if not _refs_of(ins):  # weights and constants alone: fold on the host, as freezing does
            return self.walker.fold(schema, target, ins, _source(node))
        functional = self._functional(schema, target, ins)
        if functional is not None:  # x.relu_() -> relu(x), as TorchScript's remove_mutation does
            written, (schema, target) = ins[0], functional
            result = self.walker.emit(schema, target, ins, _source(node))[0]
            self.renamed[written.id] = result
            return result
        result = self.walker.emit(schema, target, ins, _source(node))
        if not isinstance(result, list):  # the op hands back its input (a split into one piece, say)
            return [result] if _returns_list(schema) else result
        if len(schema.returns) == 1 and not _returns_list(schema):
            return result[0]
        return result if len(schema.returns) == 1 else tuple(result)

    def _functional(self, schema, target: str, ins: list):
        """The out-of-place twin of an in-place op, where writing a fresh value instead is safe: the
        written value is an activation that owns its storage and has no views."""
        twin = _functional_of(schema, target)
        written = ins[0] if ins else None
        if twin is None or not isinstance(written, Ref):
            return None
        values = self.walker.values
        for v in values[self.scanned:]:  # values with views, kept up to date as values are added
            if v.alias_of is not None:
                self.viewed.add(v.alias_of)
        self.scanned = len(values)
        if values[written.id].kind != ACTIVATION or values[written.id].alias_of is not None \
                or written.id in self.viewed or written.id in self.walker.shared:
            return None
        return twin

    def _outputs(self, node) -> list[int]:
        kinds = [s.kind for s in self.program.graph_signature.output_specs]
        if any(k != torch.export.graph_signature.OutputKind.USER_OUTPUT for k in kinds):
            raise UnsupportedError(f"{self.name}: the program writes its buffers or inputs in place; nimble "
                                   "takes programs exported in eval mode that only return results")
        out = []
        for obj in _leaves(self._value(node.args[0])):
            if isinstance(obj, torch.Tensor):
                obj = self.walker._as_ref(obj)
            if not hasattr(obj, "id"):
                raise UnsupportedError(f"{self.name} returns a {type(obj).__name__}; nimble needs programs "
                                       "that return tensors")
            out.append(obj.id)
        return out

    def _conv_batch_norm_folds(self, kinds, state):
        """{conv node: (weight, bias)} and {batch norm node: conv node} for each inference batch
        norm whose input is a convolution that nothing else reads, all of whose parameters are
        the program's own tensors. Folded as torch's FoldFrozenConvBatchnorm does."""
        def tensor(arg):
            if arg is None:
                return None
            if isinstance(arg, torch.fx.Node) and arg.op == "placeholder" and arg.name in kinds:
                value = state.get(kinds[arg.name].target)
                return value.detach() if isinstance(value, torch.Tensor) else False
            return False

        folds, skipped = {}, {}
        for bn in self.program.graph.nodes:
            if bn.op != "call_function" or getattr(bn.target, "_schema", None) is None \
                    or bn.target._schema.name != "aten::batch_norm":
                continue
            args = _schema_order(bn.target._schema, list(bn.args), dict(bn.kwargs))
            conv = args[0]
            if args[5] is not False or not isinstance(conv, torch.fx.Node) or len(conv.users) != 1 \
                    or getattr(conv.target, "_schema", None) is None or conv.target._schema.name not in _CONVOLUTIONS:
                continue
            cargs = _schema_order(conv.target._schema, list(conv.args), dict(conv.kwargs))
            if conv.target._schema.name == "aten::convolution" and cargs[6]:
                continue  # transposed
            w, b = tensor(cargs[1]), tensor(cargs[2])
            gamma, beta, mean, var = (tensor(a) for a in args[1:5])
            if any(t is False for t in (w, b, gamma, beta, mean, var)) or mean is None or var is None \
                    or not w.is_floating_point():
                continue
            scale = torch.rsqrt(var + args[7])
            scale = scale * gamma if gamma is not None else scale
            bias = (b if b is not None else torch.zeros_like(mean)) - mean
            bias = bias * scale + (beta if beta is not None else 0)
            weight = (w * scale.reshape(-1, *[1] * (w.dim() - 1))).to(w.dtype)
            bias = bias.to(w.dtype)
            base = kinds[cargs[1].name].target.removesuffix(".weight")
            self.walker.hints[id(weight)] = f"{base}.weight_fused_bn"
            self.walker.hints[id(bias)] = f"{base}.bias_fused_bn"
            self.walker.hold += [weight, bias]  # their ids stay unique while the hints are read
            folds[conv] = (weight, bias)
            skipped[bn] = conv
        return folds, skipped


def _functional_of(schema, target: str):
    """The out-of-place twin of an in-place overload ('aten::relu_.default' -> 'aten::relu.default'),
    with the same arguments, or None."""
    name = schema.name
    if not name.endswith("_") or name.endswith("__") or not schema.arguments \
            or schema.arguments[0].alias_info is None or not schema.arguments[0].alias_info.is_write:
        return None
    twin = target.replace(name, name[:-1], 1)
    try:
        fn = targets.schema_op(twin)
    except Exception:
        return None
    same = [(a.name, str(a.type)) for a in fn._schema.arguments] == [(a.name, str(a.type)) for a in schema.arguments]
    return (fn._schema, twin) if same and targets.is_allowed(twin) else None


def _concat_dim(node) -> int | None:
    """The dimension an aten.cat node joins along, made non-negative, or None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    rank = node.meta["val"].dim() if isinstance(node.meta.get("val"), torch.Tensor) else None
    return None if rank is None else dim % rank


def _nested_concats(graph) -> set:
    """The cat nodes whose one reader is a cat along the same dimension: that cat takes their
    parts directly, as TorchScript's optimizations do (inception_v3's InceptionE blocks)."""
    absorbed = set()
    for node in graph.nodes:
        dim = _concat_dim(node)
        if dim is None:
            continue
        for part in node.args[0]:
            if isinstance(part, torch.fx.Node) and len(part.users) == 1 and _concat_dim(part) == dim:
                absorbed.add(part)
    return absorbed


class _Flat:
    """A stand-in for a cat node whose absorbed parts are replaced by their own parts."""

    def __init__(self, node, parts):
        self.target, self.meta, self.name = node.target, node.meta, node.name
        self.args, self.kwargs = (parts, *node.args[1:]), node.kwargs


def _flat_concat(node, absorbed):
    def parts(n):
        return [p for a in n.args[0] for p in (parts(a) if a in absorbed else [a])]

    return _Flat(node, parts(node))


_MOVES = {"aten::transpose", "aten::unflatten", "aten::unsqueeze", "aten::squeeze", "aten::contiguous", "aten::select",
          "aten::view", "aten::reshape", "aten::permute", "aten::_unsafe_view", "aten::clone", "aten::split",
          "aten::chunk", "aten::unbind", "aten::expand"}
_MULTI_HEAD_ATTENTION = "torch.nn.modules.activation.MultiheadAttention"


def _attention_blocks(graph, kinds, state) -> tuple[dict, set]:
    """nn.MultiheadAttention (batch_first self-attention, packed projection, no mask, no attention
    weights) as exported: torch.export records its general path, about 25 view, copy and select
    ops around the projections and scaled dot-product attention. Returns {last node: (input,
    embed, heads, in-projection weight and bias, out-projection weight and bias)} and the other
    nodes of each such block, so the block lowers as the fast path's ops, the same ops a trace
    records (`Walker._multi_head_attention`). A block that differs in any way lowers op by op."""
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
    _, _, _, mask, dropout, causal, *rest = _schema_order(attend.target._schema, list(attend.args), dict(attend.kwargs))
    if tuple(tensors[0].shape) != (3 * embed, embed) or tuple(tensors[2].shape) != (embed, embed) \
            or not isinstance(out, torch.Tensor) or out.dim() != 4 or mask is not None or dropout != 0 or causal \
            or any(r not in (None, False) for r in rest):
        return None  # separate q/k/v weights, a mask, dropout, causal attention or a scale: op by op
    return x, int(embed), int(out.shape[1]), w, b, proj_w, proj_b


def _returns_list(schema) -> bool:
    """The op returns Tensor[] (split, chunk, unbind), whatever its alias annotation."""
    return len(schema.returns) == 1 and isinstance(schema.returns[0].type, torch.ListType)


def _schema_order(schema, args: list, kwargs: dict) -> list:
    """The node's arguments in schema order, defaults filled in."""
    out = []
    positional = list(args)
    for i, a in enumerate(schema.arguments):
        if not a.kwarg_only and i < len(positional):
            out.append(positional[i])
        elif a.name in kwargs:
            out.append(kwargs[a.name])
        elif a.has_default_value():
            out.append(a.default_value)
        else:
            raise UnsupportedError(f"{schema.name}: argument '{a.name}' is missing")
    return out


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
        if not file.startswith(torch_dir) and not _TORCH_FILE.search(file):
            return f"{file}:{line}"
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else f"<graph node {node.name}>"
