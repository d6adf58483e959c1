"""Seeing every change to a module's tensors after `Nimble.prepare`, at no cost per call.

A model prepared for inference runs on its own copies of the module's weights (folded, cast,
laid out for its kernels), so a change to the module after `prepare` would leave those copies
stale. Checking every tensor on every call (identity, storage and version of each) cost 0.05 ms
for resnet50, and still missed writes through `.data`, which has a version counter of its own.
So instead each watched tensor is told apart by its class: a subclass of its own (`Parameter`
or `Tensor`) whose `__torch_function__` sees every torch call that touches it, and notes:

- a write: an in-place method or function (`mul_`, `copy_`, `set_`, `zero_`, `uniform_`,
  `_foreach_add_`...), `t[i] = v`, `t += v`, `out=t`, and `t.data = other`;
- an alias: `.data`, `detach()`, a view or a slice of it is watched too, so a write through it
  is seen (`conv.weight.data.mul_(2)` included);
- a replacement: a module's parameter, buffer or submodule set anew (`m.weight = ...`,
  `load_state_dict(assign=True)`), through torch's registration hooks and a module's own dicts.

A call then only asks whether anything was noted. Everything else about the tensors is as it
was: ops on them give plain tensors, `repr`, `copy.deepcopy` and pickling see the original class,
and `unwatch` (run when the prepared model is dropped or prepared again) puts the class back.
Writes that bypass torch (through NumPy's view of a CPU tensor, DLPack or a raw storage) are not
seen; TorchScript modules, whose tensors are not Python objects of their own, are checked the
old way (`guards.EveryTensor`).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch._C import DisableTorchFunctionSubclass

# in-place methods that write no value
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_", "register_hook", "_fix_weakref",
                         "pin_memory_", "record_stream_", "detach_"})
_IN_PLACE_OPERATORS = frozenset({f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                                                          "and", "or", "xor", "lshift", "rshift", "matmul")})
_AS_ORIGINAL = frozenset({"__repr__", "__str__", "__format__", "__deepcopy__", "__reduce_ex__", "__reduce__"})
_DATA_GET = torch._C.TensorBase.data.__get__
_DATA_SET = torch._C.TensorBase.data.__set__


_MISSING = object()


class Watch:
    """What a prepared model watches; `changed` is None until a change is noted, then one line
    saying which tensor and how. A module's table written (a parameter, buffer or submodule set)
    is a suspect until the next look: torch.export, say, swaps a module's parameters for its own
    while it traces and puts them back, so only one that is not the original then is a change."""

    def __init__(self):
        self._changed: str | None = None
        self._suspects: list[tuple] = []  # (weakref module, table attribute, name, what to say)
        self._originals: dict[tuple[int, str, str], object] = {}  # (id(module), table, name) -> what it held
        self._release = lambda: None

    @property
    def changed(self) -> str | None:
        if self._changed is None and self._suspects:
            suspects, self._suspects = self._suspects, []
            for mref, table, name, what in suspects:
                m = mref()
                if m is not None and getattr(m, table).get(name, _MISSING) is not \
                        self._originals.get((id(m), table, name), _MISSING):
                    self._changed = what
                    break
        return self._changed

    def note(self, what: str) -> None:
        if self._changed is None:
            self._changed = what

    def suspect(self, module, table: str, name: str, what: str) -> None:
        self._suspects.append((weakref.ref(module), table, name, what))

    def release(self) -> None:
        """Stop watching now (the tensors get their classes back); what was noted stays."""
        self._release()


class _Watched:
    """The mixin of both watched classes; a watched tensor's `_nimble_watchers` lists
    (weakref to a Watch, qualified name) pairs, shared with its aliases."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _AS_ORIGINAL and args and isinstance(args[0], _Watched):
            with _as_original(args[0]):
                return func(*args, **kwargs)
        for t, why in _written(func, name, args, kwargs):
            _note(t, why)
        with DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        sources = [a for a in _tensors(args) if isinstance(a, _Watched)]
        if sources:
            for o in _tensors(out if isinstance(out, (tuple, list)) else (out,)):
                if type(o) is torch.Tensor and any(_shares(o, s) for s in sources):
                    o.__class__ = WatchedTensor  # an alias: writes through it are writes to the source
                    o._nimble_watchers = getattr(sources[0], "_nimble_watchers", [])
        return out

    def set_(self, *args, **kwargs):  # torch does not route set_ through __torch_function__
        _note(self, "was given new storage (set_)")
        with DisableTorchFunctionSubclass():
            return super().set_(*args, **kwargs)


class WatchedParameter(_Watched, torch.nn.Parameter):
    def __deepcopy__(self, memo):
        with _as_original(self):
            return self.__deepcopy__(memo)

    def __reduce_ex__(self, proto):
        with _as_original(self):
            return self.__reduce_ex__(proto)


class WatchedTensor(_Watched, torch.Tensor):
    pass


_ORIGINAL = {WatchedParameter: torch.nn.Parameter, WatchedTensor: torch.Tensor}
_WATCHED = {torch.nn.Parameter: WatchedParameter, torch.Tensor: WatchedTensor}


@contextlib.contextmanager
def _as_original(t):
    """`t` as its original class, without its watchers: what repr, copy and pickle see."""
    watched = t.__class__
    watchers = t.__dict__.pop("_nimble_watchers", None)
    t.__class__ = _ORIGINAL[watched]
    try:
        yield
    finally:
        t.__class__ = watched
        if watchers is not None:
            t._nimble_watchers = watchers


def _tensors(items):
    for a in items:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (b for b in a if isinstance(b, torch.Tensor))


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        pa, pb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor without storage
        return False
    return pa != 0 and pa == pb and a.device == b.device


def _written(func, name: str, args, kwargs) -> list[tuple[torch.Tensor, str]]:
    """The watched tensors this call writes, each with how."""
    found = []
    if func == _DATA_SET:
        found.append((args[0], "was given new storage (.data = ...)"))
    elif (name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES) or name == "__setitem__" \
            or name in _IN_PLACE_OPERATORS:
        first = args[0] if args else None
        targets = first if isinstance(first, (list, tuple)) else [first]
        how = {"set_": "was given new storage (set_)", "__setitem__": "was written (t[...] = ...)"}.get(
            name, f"was written in place ({name.strip('_')})")
        found += [(t, how) for t in targets if isinstance(t, _Watched)]
    out = kwargs.get("out")
    for t in _tensors(out if isinstance(out, (list, tuple)) else (out,)):
        if isinstance(t, _Watched):
            found.append((t, "was written as out="))
    return found


def _note(t, why: str) -> None:
    for ref, qualified in getattr(t, "_nimble_watchers", ()):
        watch = ref()
        if watch is not None:
            watch.note(f"'{qualified}' {why}")


# ------------------------------------------------------------------------------ modules
_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> [(weakref Watch, prefix)]
_hooks_installed = False


_TABLES = {"a parameter": "_parameters", "a buffer": "_buffers", "a submodule": "_modules"}


def _replaced(module, name, value, kind):
    for ref, prefix in _MODULES.get(module, ()):
        watch = ref()
        if watch is not None:
            watch.suspect(module, _TABLES[kind], name, f"'{prefix}{name}' was replaced or removed ({kind})")
    return None


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    from torch.nn.modules import module as m

    m.register_module_parameter_registration_hook(lambda mod, name, v: _replaced(mod, name, v, "a parameter"))
    m.register_module_buffer_registration_hook(lambda mod, name, v: _replaced(mod, name, v, "a buffer"))
    m.register_module_module_registration_hook(lambda mod, name, v: _replaced(mod, name, v, "a submodule"))
    _hooks_installed = True


class _Table(dict):
    """A module's `_parameters` or `_buffers`, noting what is set or removed directly (as
    `Module._apply` and `del module.weight` do); pickled and copied as a plain dict."""

    __slots__ = ("owner", "kind")

    def _changed(self, name):
        owner = self.owner()
        if owner is not None:
            _replaced(owner, name, None, self.kind)

    def __setitem__(self, name, value):
        if self.get(name) is not value:
            self._changed(name)
        super().__setitem__(name, value)

    def __delitem__(self, name):
        self._changed(name)
        super().__delitem__(name)

    def pop(self, name, *default):
        self._changed(name)
        return super().pop(name, *default)

    def popitem(self):
        name, value = super().popitem()
        self._changed(name)
        return name, value

    def clear(self):
        for name in list(self):
            self._changed(name)
        super().clear()

    def update(self, *args, **kwargs):
        for name, value in dict(*args, **kwargs).items():
            self[name] = value

    def setdefault(self, name, value=None):
        if name not in self:
            self[name] = value
        return self[name]

    def __reduce__(self):
        return dict, (dict(self),)


def watchable(module: torch.nn.Module) -> bool:
    """Whether `watch` can see every change to `module`: a plain module whose tensors are plain
    parameters and tensors (not TorchScript's, nor subclasses of someone else's)."""
    if isinstance(module, torch.jit.ScriptModule):
        return False
    for m in module.modules():
        if type(m._parameters) not in (dict, _Table) or type(m._buffers) not in (dict, _Table):
            return False
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None and type(t) not in (torch.nn.Parameter, torch.Tensor, WatchedParameter, WatchedTensor):
                return False
    return True


def watch(module: torch.nn.Module) -> Watch:
    """Watch every parameter, buffer and submodule of `module` (see the module docstring) until
    the returned Watch is dropped."""
    _install_hooks()
    w = Watch()
    ref = weakref.ref(w)
    tensors = []
    for prefix, m in module.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        _MODULES.setdefault(m, []).append((ref, prefix))
        for table in _TABLES.values():
            for name, held in getattr(m, table).items():
                w._originals[(id(m), table, name)] = held
        for attr, kind in (("_parameters", "a parameter"), ("_buffers", "a buffer")):
            table = getattr(m, attr)
            if type(table) is dict:
                watched = _Table(table)
                watched.owner, watched.kind = weakref.ref(m), kind
                object.__setattr__(m, attr, watched)
        for name, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is None:
                continue
            if type(t) in _WATCHED:
                t.__class__ = _WATCHED[type(t)]
                t._nimble_watchers = []
            t._nimble_watchers.append((ref, f"{prefix}{name}"))
            tensors.append(t)
    w._release = weakref.finalize(w, _unwatch, ref, module, tensors)
    return w


def _unwatch(ref, module, tensors) -> None:
    for t in tensors:
        t._nimble_watchers[:] = [e for e in t._nimble_watchers if e[0] is not ref]
        if not t._nimble_watchers and type(t) in _ORIGINAL:
            t.__class__ = _ORIGINAL[type(t)]
    for m in module.modules():
        entries = _MODULES.get(m)
        if entries is not None:
            entries[:] = [e for e in entries if e[0] is not ref]
            if not entries:
                del _MODULES[m]
                for attr in ("_parameters", "_buffers"):
                    if type(getattr(m, attr)) is _Table:
                        object.__setattr__(m, attr, dict(getattr(m, attr)))
