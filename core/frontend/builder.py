"""The graph builder every frontend emits through: IR values and ops from aten calls, typed on the
meta device (or, where this torch lacks a meta kernel, on the CPU).

A frontend reads its format (a TorchScript graph, a torch.export program) and calls `emit` for
each device op, `fold` for host work on constants, and `add_input` for each input; `as_ref` turns
a host tensor into a weight. It emits what the model says and rewrites nothing: common
subexpressions, repeated views and the rest are passes (`passes/`). It only skips what needs no op
(a view with its input's exact geometry, an op that hands back its input) and picks the canonical
overload (`x / 4.0` as `div.Scalar`). `finalize` turns what it built into a `Graph`.
"""

from __future__ import annotations

import re

import torch

from ..errors import ShapeError, UnsupportedError, first_line
from ..ir import ACTIVATION, INPUT, WEIGHT, Op, Ref, TensorSpec, Value
from ..ops import arguments, fusion, shapes, targets, types
from ..ops.allowlist import DATA_DEPENDENT, HOST_FOLDABLE, NONDETERMINISTIC
from ..ops.arguments import call_schema
from . import views

_META = torch.device("meta")
IDENTITY_WHEN_NOT_TRAINING = {"aten::dropout", "aten::feature_dropout", "aten::alpha_dropout",
                               "aten::feature_alpha_dropout", "aten::dropout_", "aten::feature_dropout_",
                               "aten::alpha_dropout_", "aten::feature_alpha_dropout_"}  # (input, p, train)
_UPDATES_RUNNING_STATS = {"aten::batch_norm", "aten::instance_norm"}  # (input, w, b, mean, var, training, ...)
FOLD_LIMIT = 2**30  # bytes one host fold may allocate, and all of them together twice that (at least)
TORCH_FILE = re.compile(r"[/\\](site|dist)-packages[/\\]torch[/\\]")
# A number where the Tensor overload takes a tensor: the Scalar overload, which computes the same
# and which the pointwise fusion takes, as a trace gives.
_SCALAR_TWINS = {f"aten::{op}.Tensor": f"aten::{op}.Scalar" for op in ("add", "sub", "mul", "div")}
# elementwise ops whose result has the broadcast shape of their tensor arguments: on traced sizes
# (tensors of one element) and numbers, a result of one element, sized without the meta kernel
_ELEMENTWISE_ON_SIZES = frozenset({*fusion.POINTWISE, "aten::floor_divide.default", "aten::floor_divide.Scalar",
                                   "aten::remainder.Tensor", "aten::remainder.Scalar", "aten::div.Tensor_mode",
                                   "aten::pow.Tensor_Tensor"})


def _shape_rule(target: str, ins: list) -> list | None:
    """The results of `target` on the meta tensors `ins` by its shape rule, or None where it has
    none that answers (a rule that refuses the inputs answers nothing here either)."""
    try:
        return shapes.infer(target, ins, {})
    except (TypeError, ValueError, RuntimeError):
        return None


class GraphBuilder:
    """The values, ops and weights of one model as a frontend emits them."""

    def __init__(self, name: str, training: bool = False, strict_folding: bool = False,
                 fold_limit: int = FOLD_LIMIT, views_may_copy: bool = False):
        """`training`: random ops stay device ops, and training-mode batch norm counts as writing
        its running statistics. `strict_folding`:
        fold on the host only allowlisted ops and HOST_FOLDABLE ones (a `.pt2` is data; a
        TorchScript `.pt` is a program that the check runs anyway). Every fold is sized first and
        refused beyond `fold_limit` bytes. `views_may_copy`: a view that nimble's layout does not
        allow becomes a copy (`_copied_view`), for graphs recorded from an eager run, where it
        worked."""
        self.name = name
        self.strict_folding, self.fold_limit, self.folded_bytes = strict_folding, fold_limit, 0
        self.training = training
        self.values: list[Value] = []
        self.ops: list[Op] = []
        self.meta: dict[int, torch.Tensor] = {}  # value id -> meta tensor
        self.root_of: dict[int, int] = {}  # id(meta tensor) -> value id that owns its storage
        self.weights: dict[str, torch.Tensor] = {}
        self._suffix: dict[str, int] = {}  # base name -> the next suffix to try
        self.weight_of: dict[int, int] = {}  # id(host tensor) -> weight value id
        self.hold: list[torch.Tensor] = []  # keeps host tensors alive so their ids stay unique
        self.unset: set[int] = set()  # ids of host tensors from torch.empty not yet filled
        self.hints: dict[int, str] = {}  # id(host tensor) -> name of the constant it came from
        self.inputs: list[int] = []
        self.views_may_copy = views_may_copy  # a graph recorded from eager runs (export): `_copied_view`
        self.copied: set[int] = set()  # storage roots of views that had to be copies

    def name_constant(self, tensor: torch.Tensor, name: str) -> None:
        """Name the weight `tensor` becomes if a device op reads it ('layer1.0.weight')."""
        self.hints[id(tensor)] = name
        self.hold.append(tensor)  # its id stays unique while the hint is read

    # values -----------------------------------------------------------------------------------
    def _new_value(self, kind, tensor, name, producer=None, alias_of=None) -> Ref:
        spec = TensorSpec(tuple(tensor.shape), types.dtype_name(tensor.dtype), tuple(tensor.stride()),
                          tensor.storage_offset())
        vid = len(self.values)
        self.values.append(Value(vid, kind, spec, name, producer, alias_of))
        meta = tensor if tensor.device == _META else torch.empty_strided(
            tensor.shape, tensor.stride(), dtype=tensor.dtype, device=_META)
        if meta.storage_offset() != spec.offset:  # a CPU stand-in's view: keep its offset
            meta = torch.empty(spec.storage_nbytes // tensor.element_size(), dtype=tensor.dtype,
                               device=_META).as_strided(tensor.shape, tensor.stride(), spec.offset)
        self.meta[vid] = meta
        root = vid if alias_of is None else alias_of
        self.root_of.setdefault(id(meta), root)
        if meta._is_view():  # a fresh result that is a view of a temporary inside its op
            self.root_of.setdefault(id(meta._base), root)
        return Ref(vid)

    def add_input(self, name: str, spec: TensorSpec) -> Ref:
        """The next graph input."""
        ref = self._new_value(INPUT, torch.empty(spec.shape, dtype=types.DTYPES[spec.dtype], device=_META), name)
        self.inputs.append(ref.id)
        return ref

    def as_ref(self, obj):
        """A host tensor used by a device op becomes a weight; other objects pass through."""
        if isinstance(obj, Ref):
            return obj
        if isinstance(obj, torch.Tensor):
            key = id(obj)
            if key not in self.weight_of:
                name = self._weight_name(self.hints.get(key, "const"))
                tensor = obj.detach().contiguous()
                self.weights[name] = tensor
                self.weight_of[key] = self._new_value(WEIGHT, tensor, name).id
                self.hold.append(obj)
            return Ref(self.weight_of[key])
        if isinstance(obj, (list, tuple)):
            return tuple(self.as_ref(o) for o in obj)
        return obj

    def _weight_name(self, hint: str) -> str:
        base = hint.removeprefix("self.")
        if not base or base.replace(".", "").isdigit():
            base = "const"
        name, n = base, self._suffix.get(base, 1)
        while name in self.weights:  # one try per name taken, not one per earlier weight
            name, n = f"{base}_{n}", n + 1
        self._suffix[base] = n
        return name

    # walking ----------------------------------------------------------------------------------

    def tensor_of(self, obj) -> torch.Tensor:
        return self.meta[obj.id] if isinstance(obj, Ref) else obj

    def check_reads(self, schema, target: str, ins: list, source: str) -> None:
        """Refuse an op that reads a tensor from torch.empty before it was filled in whole."""
        if not self.unset or not any(id(a) in self.unset for a in flat(ins)):
            return
        named = schema.name if not schema.overload_name else f"{schema.name}.{schema.overload_name}"
        if (schema.name not in _OVERWRITES and named not in _OVERWRITES) \
                or any(id(a) in self.unset for a in flat(ins[1:])):
            raise UnsupportedError(f"{self.name}: {target} at {source} reads uninitialized memory (from "
                                   "torch.empty); nimble runs deterministic graphs only")
        if schema.name.endswith("_"):  # torch.empty(...).fill_(v): set in whole before any read
            self.unset.discard(id(ins[0]))

    def fold(self, schema, target: str, ins: list, source: str):
        """Run an op on host values alone (weights, constants, traced shapes) now, as freezing
        does. A random op is refused; a torch.empty result may only be filled (`check_reads`); with
        `strict_folding` only allowlisted and HOST_FOLDABLE ops run. Each result is sized on the
        meta device before it runs."""
        short = target.split("::")[1].split(".")[0]
        if short in NONDETERMINISTIC and short not in _UNINITIALIZED:
            raise UnsupportedError(f"{self.name}: {target} at {source} draws random numbers; nimble runs "
                                   "deterministic graphs only")
        overload = target.rsplit(".", 1)[-1]
        if self.strict_folding and not targets.is_allowed(target) and \
                (short not in HOST_FOLDABLE or "out" in overload or "names" in overload):
            raise UnsupportedError(f"{self.name}: {target} at {source} is not an op nimble runs, so it was not "
                                   "run; see docs/supported-ops.md")
        self._size_fold(schema, target, ins, source)
        result = call_schema(schema, target, ins)
        if short in _UNINITIALIZED and result.numel():
            self.unset.add(id(result))
            self.hold.append(result)
        return result

    def _size_fold(self, schema, target: str, ins: list, source: str) -> None:
        """Refuse a fold whose results would pass `fold_limit` bytes, or all folds together twice
        that, from a run on the meta device. An op without a meta kernel cannot be sized first: in
        strict folding it is refused, else it runs. Arithmetic on traced sizes (`x.size(-1) //
        heads`: tensors of one element and numbers) makes one element and is not run on the meta
        device: the first such run imports sympy, 0.6 s of a transformer's compile. An op with a
        shape rule (`shapes.infer`: an embedding of constant ids, say) is sized by the rule."""
        if target in _ELEMENTWISE_ON_SIZES and all(
                isinstance(obj, torch.Tensor) and obj.numel() <= 1 or isinstance(obj, (bool, int, float, type(None)))
                for obj in ins):
            self.folded_bytes += 8
            return
        def meta(obj):
            if isinstance(obj, torch.Tensor):
                return obj.to(_META)
            return [meta(o) for o in obj] if isinstance(obj, (list, tuple)) else obj

        ins = [_META if spec.name == "device" else meta(obj) for spec, obj in zip(schema.arguments, ins)]
        try:
            inferred = _shape_rule(target, ins)  # a rule where there is one: the meta kernel's first run imports
            results = inferred if inferred is not None else list(flat([call_schema(schema, target, ins)]))
        except Exception:
            if self.strict_folding:
                raise UnsupportedError(f"{self.name}: {target} at {source} on constants cannot be sized before "
                                       "it runs, so it was not run") from None
            return
        size = sum(t.numel() * t.element_size() for t in results if isinstance(t, torch.Tensor) and not t._is_view())
        self.folded_bytes += size
        if size > self.fold_limit or self.folded_bytes > 2 * self.fold_limit:
            raise UnsupportedError(f"{self.name}: {target} at {source} would make {size} bytes of constants on the "
                                   f"host ({self.folded_bytes} in all); nimble folds at most {self.fold_limit} "
                                   "bytes per op")

    def op(self, target: str, ins: list, source: str) -> Ref:
        """Emit `target` on `ins` (schema order, defaults left off); its first result."""
        schema = targets.resolve(target)._schema
        ins = list(ins) + [a.default_value for a in schema.arguments[len(ins):]]
        result = self.emit(schema, target, ins, source)
        return result if isinstance(result, Ref) else result[0]

    def emit(self, schema, target: str, ins: list, source: str) -> Ref | list[Ref]:
        """Append the device op `target` applied to `ins` (in schema order: Refs, host tensors,
        which become weights, and plain values), typed on the meta device. Returns its results'
        Refs, or the input's own Ref where the op would hand back its input unchanged. Every
        frontend lowers its device ops through here."""
        if target in _SCALAR_TWINS and isinstance(ins[1], (int, float)) and not isinstance(ins[1], bool):
            target = _SCALAR_TWINS[target]  # x / 4.0 as export records it: div.Tensor with a number
            schema = targets.resolve(target)._schema
        view = views.as_view(self.meta, target, ins)  # a view by another name (a restride, autograd's reshape)
        if view is not None:
            target, ins = view
            schema = targets.resolve(target)._schema
        if _shape_from_values(schema, ins, self.meta):
            raise UnsupportedError(f"{self.name}: {target} at {source} returns a tensor whose shape depends on "
                                   "the values of its input; nimble compiles graphs whose shapes follow from the "
                                   "input shapes alone (run such steps, detection post-processing say, in PyTorch)")
        if not targets.is_allowed(target, self.training):
            raise UnsupportedError(f"{self.name}: op {target} at {source} is not supported; "
                                   "see docs/supported-ops.md")
        args, kwargs = arguments.by_schema(schema, [self.as_ref(obj) for obj in ins])
        fn = targets.resolve(target, self.training)
        refs = refs_in(args + [v for _, v in kwargs])
        try:
            results, used = self._call(fn, args, kwargs, refs, _META, target)
        except NotImplementedError:  # no meta kernel in this torch: run it for real on zeros
            results, used = self._call(fn, args, kwargs, refs, torch.device("cpu"))
        except Exception as e:
            if self.views_may_copy and target == "aten::view.default" and _NOT_VIEWABLE in str(e):
                return self._copied_view(ins, source)
            given = [self.values[r] for r in refs_in(args) if self.values[r].kind == INPUT]
            if given:  # the model's own input does not fit the first op that reads it: a --shape mistake
                x = given[0]
                weights = {self.values[r].spec.dtype for r in refs_in(args) if self.values[r].kind == WEIGHT}
                if weights and x.spec.dtype not in weights:  # a precision mistake: say so, not the shape
                    theirs = sorted(weights)[0]
                    raise ShapeError(f"{self.name}: input '{x.name}' is {x.spec.dtype} but the weights of {target} at "
                                     f"{source}, which reads it, are {theirs}: give --dtype {theirs} (the model's own), "
                                     f"or convert the model to {x.spec.dtype} before saving it") from e
                raise ShapeError(f"{self.name}: input '{x.name}' of shape {'x'.join(map(str, x.spec.shape)) or 'scalar'} "
                                 f"({x.spec.dtype}) does not fit {target} at {source}, which reads it: "
                                 f"{first_line(e)}; check --shape (and --dtype) for this input") from e
            shapes = ", ".join(str(list(self.meta[r].shape)) for r in refs_in(args))
            raise ShapeError(f"{self.name}: op {target} at {source} rejects its inputs "
                             f"(tensor shapes {shapes}): {first_line(e)}") from e
        passed = {id(t): r for r, t in used.items()}  # `used` keeps the stand-ins alive, so ids stay unique
        writes = _written_args(schema, args, kwargs)
        if self.training and schema.name in _UPDATES_RUNNING_STATS and args[5] is True:
            writes += refs_in(args[3:5])  # running_mean, running_var: updated in place, unannotated
        if any(self._root(w) in self.copied for w in writes):
            raise UnsupportedError(f"{self.name}: {target} at {source} writes in place a tensor that a view shares "
                                   "storage with, where nimble's layout made that view a copy; export the model "
                                   "without the in-place write")
        results = arguments.masked(schema, ins, results)
        missing = [k for k, t in enumerate(results) if t is None]  # results the op was asked not to give
        results = [t for t in results if t is not None]
        if not writes and len(results) == 1 and id(results[0]) in passed and not missing:
            # The op hands back its own input (contiguous on a contiguous tensor, a no-op .to):
            # nothing to run.
            return Ref(passed[id(results[0])])
        same = arguments.same_view(schema, args, results, used)
        if not writes and same is not None:  # a view with its input's exact geometry (x[:, :]): nothing to run
            return Ref(same)
        op_id = len(self.ops)
        out_refs = []
        for t in results:
            alias = None
            if id(t) in passed:  # written in place and handed back
                alias = self._root(passed[id(t)])
            elif t._is_view() and id(t._base) in passed:
                alias = self._root(passed[id(t._base)])
            elif t._is_view():  # a view of a known value, or else of a temporary inside the op
                alias = self.root_of.get(id(t._base))
            elif schema.name in ALWAYS_ALIAS and isinstance(args[0], Ref):  # its input's storage, not a view to torch
                alias = self._root(args[0].id)
            name = f"{short_name(target)}_{op_id}"
            out_refs.append(self._new_value(ACTIVATION, t, name, op_id, alias))
        self.ops.append(Op(op_id, target, tuple(args), tuple(kwargs),
                           tuple(r.id for r in out_refs), tuple(writes), (), source))
        for k in missing:
            out_refs.insert(k, None)
        return out_refs

    def _copied_view(self, ins: list, source: str) -> Ref | list[Ref]:
        """`x.view(shape)` where nimble's layout of x (a result whose strides nimble chose, such as
        attention's) does not allow that view, though the layout the model was exported with did:
        the same elements, as a reshape, which copies. Its input and result are noted, and an op
        that later writes in place into either storage is refused (a copy would not see it)."""
        schema = targets.resolve("aten::reshape.default")._schema
        result = self.emit(schema, "aten::reshape.default", ins[:2], source)
        copy = result if isinstance(result, Ref) else result[0]
        self.copied.update(self._root(r.id) for r in (copy, ins[0]) if isinstance(r, Ref))
        return result

    def _call(self, fn, args, kwargs, refs, device, target: str | None = None):
        """Run `fn` on stand-ins for its tensors: meta tensors (through the op's shape rule where
        it has one, which is much faster than its meta kernel), or on the CPU, weights and zeros.
        Returns the flat results and the stand-in of each value read."""
        if device == _META:
            tensors = self.meta
        else:
            tensors = {r: self._cpu_example(r) for r in refs}
        call_args = [arguments.to_torch(a, tensors, device) for a in args]
        call_kwargs = {k: arguments.to_torch(v, tensors, device) for k, v in kwargs}
        inferred = shapes.infer(target, call_args, call_kwargs) if device == _META and target else None
        results = inferred if inferred is not None else arguments.flatten_result(fn(*call_args, **call_kwargs), True)
        return results, {r: tensors[r] for r in refs}

    def _cpu_example(self, vid: int) -> torch.Tensor:
        v = self.values[vid]
        if v.kind == WEIGHT:
            return self.weights[v.name].cpu()  # a module prepared for training may live on the GPU
        meta = self.meta[vid]
        return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype).zero_()

    def _root(self, vid: int) -> int:
        alias = self.values[vid].alias_of
        return vid if alias is None else alias


# ops whose result is always their input's tensor under another name (`_is_view()` says no: an
# arena buffer bound as its result would be taken for a buffer of its own)
ALWAYS_ALIAS = frozenset({"aten::detach", "aten::alias"})


def short_name(target: str) -> str:
    return target.split("::")[-1].split(".")[0]


def _shape_from_values(schema, ins: list, meta: dict) -> bool:
    """The op's result shape depends on the values of a device tensor: a DATA_DEPENDENT op,
    `where(condition)`, or indexing with a boolean mask that the model computed."""
    if schema.name in DATA_DEPENDENT or (schema.name == "aten::where" and len(schema.arguments) == 1):
        return True
    if schema.name in ("aten::index", "aten::index_put", "aten::index_put_") and len(ins) > 1:
        return any(isinstance(i, Ref) and meta[i.id].dtype in (torch.bool, torch.uint8) for i in flat([ins[1]]))
    return False


_NOT_VIEWABLE = "view size is not compatible with input tensor's size and stride"
_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_OVERWRITES = {  # read no element of their first argument, only its shape and dtype (by name, or name.overload)
    "aten::fill_", "aten::zero_", "aten::fill", "aten::zero", "aten::full_like", "aten::zeros_like", "aten::ones_like",
    "aten::empty_like", "aten::new_zeros", "aten::new_ones", "aten::new_full", "aten::new_empty",
    # random fills of a training step: `torch.empty(...).bernoulli_(p)` (stochastic depth) becomes
    # `bernoulli.p` in torch's functional trace; plain `bernoulli` reads its input as probabilities
    "aten::bernoulli.p", "aten::bernoulli_.float", "aten::uniform_", "aten::normal_",
}


def flat(objs):
    for o in objs:
        if isinstance(o, dict):
            yield from flat(list(o.values()))  # in insertion order, as the model built it
        elif isinstance(o, (list, tuple)):
            yield from flat(o)
        else:
            yield o


def refs_in(args):
    return [a.id for a in flat(args) if isinstance(a, Ref)]


def _written_args(schema, args, kwargs) -> list[int]:
    """Value ids the op writes in place, from the schema's `Tensor(a!)` annotations."""
    by_name = dict(kwargs)
    positional = [a for a in schema.arguments if not a.kwarg_only]
    written = []
    for spec in schema.arguments:
        if spec.alias_info is not None and spec.alias_info.is_write:
            arg = by_name[spec.name] if spec.kwarg_only else args[positional.index(spec)]
            written.extend(refs_in([arg]))
    return written
