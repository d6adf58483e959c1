"""Tensors that say they are on CUDA and hold nothing but their shape: what a prebuild
(`runtime/prebuild.py`) walks a load's op lists with, on a machine that may have no GPU.

A `Claimed` tensor wraps a meta tensor. Every aten op on it runs on the meta tensor (shapes,
strides and dtypes only, no data) and its results claim CUDA too; a factory call for a CUDA
device inside `walking()` makes one as well (`_factories`). Its address is one that the caching
allocator could have given (`data_ptr`: a multiple of 512 plus its offset into its storage), so
the alignment a kernel is specialised on is the one a load sees: every allocation a load makes is
512-byte aligned (`regions.py`), and views keep their offsets.

What a value would read (`item`, `bool`, `float`) reads as the value under which a measured
choice tries every candidate: a result is finite, a difference is zero, a time is one
microsecond (`timing.py`). So a walk goes down every branch a load could take by measurement.

`SEEN` collects the kernel launches a walk makes (`kernels/generated.py` notes them there,
launching nothing)."""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch.utils._pytree import tree_map

ADDRESS = 512  # where every root allocation of a walk starts: aligned as the caching allocator aligns

SEEN: contextvars.ContextVar[list | None] = contextvars.ContextVar("nimble_kernels_seen", default=None)
# this thread's walk: the device its tensors claim, and each storage's address (`_base`)
_STATE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("nimble_walk_state", default=None)


def walking() -> bool:
    """Whether this thread walks an op list over claimed tensors (then nothing may run on a GPU)."""
    return SEEN.get() is not None


class Claimed(torch.Tensor):
    """A tensor that says it is on a CUDA device (`walk`'s) and holds only its shape (a meta
    tensor inside)."""

    meta: torch.Tensor

    @staticmethod
    def __new__(cls, meta: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, meta.shape, strides=meta.stride(),
                                                storage_offset=meta.storage_offset(), dtype=meta.dtype,
                                                device=_state()["device"], requires_grad=False)
        t.meta = meta
        return t

    def __repr__(self):
        return f"Claimed({tuple(self.shape)}, {self.dtype})"

    # indexing and copying check the device before dispatch (no CUDA here): done on the meta tensor
    def __getitem__(self, index):
        return Claimed(self.meta[tree_map(_meta, index)])

    def __setitem__(self, index, value) -> None:
        self.meta[tree_map(_meta, index)] = _meta(value)

    def copy_(self, src, non_blocking: bool = False):
        self.meta.copy_(_meta(src))
        return self

    def data_ptr(self) -> int:
        return _base(self.meta) + self.meta.storage_offset() * self.element_size()

    def untyped_storage(self):
        return _Storage(_base(self.meta), self.meta.untyped_storage().nbytes())

    def item(self):
        return True if self.dtype == torch.bool else 0

    def __bool__(self) -> bool:
        return True

    def __float__(self) -> float:
        return 0.0

    def tolist(self):
        return self.item() if self.dim() == 0 else [0] * self.shape[0]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _WHOLE_TRUTH:  # all() and any() over a whole tensor: their meta kernels import dynamo too
            return Claimed(torch.empty((), dtype=torch.bool, device="meta"))
        quick = _elementwise(func, args, kwargs)
        if quick is not None:
            return quick
        try:
            out = func(*_metas(args), **{k: _metas(v) for k, v in kwargs.items()})
        except NotImplementedError:  # an op with no meta kernel: its `out=` form leaves its shape there
            if "out" in kwargs:
                return kwargs["out"]
            if func not in _CONVOLUTIONS:
                raise
            out = _CONVOLUTIONS[func](*_metas(args))
        return _claim(out) if isinstance(out, torch.Tensor) else tree_map(_claim, out)


_WHOLE_TRUTH = frozenset({torch.ops.aten.all.default, torch.ops.aten.any.default})
_COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "logical_and", "logical_or",
                          "logical_not", "logical_xor", "signbit"})


def _elementwise(func, args, kwargs) -> Claimed | None:
    """The result of an elementwise op over floating (or two bool) tensors, made here; None for
    any other op. torch's meta kernels for these are Python decompositions whose first call
    imports torch._dynamo (1.3 to 1.7 s of a walk). The result has the broadcast shape, the promoted
    dtype (bool for a comparison), and is channels_last where a 4-D operand of that shape is,
    as TensorIterator lays it out."""
    if kwargs or torch.Tag.pointwise not in func.tags or func._schema.is_mutable or len(func._schema.returns) != 1:
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    scalars = [a for a in args if not isinstance(a, torch.Tensor)]
    name = func._schema.name.split("::")[-1]
    if not tensors or len(tensors) > 2 or not all(t.dtype.is_floating_point or t.dtype == torch.bool
                                                  for t in tensors) \
            or not all(isinstance(a, (int, float, bool)) for a in scalars):
        return None
    if len(tensors) == 1 and tensors[0].dtype == torch.bool and name not in _COMPARISONS:
        return None  # a bool tensor alone may promote with its scalars (torch's meta kernel says how)
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    if name in _COMPARISONS:
        dtype = torch.bool
    elif len(tensors) == 2:
        dtype = torch.result_type(_meta(tensors[0]), _meta(tensors[1]))
    else:
        dtype = tensors[0].dtype
    last = len(shape) == 4 and any(tuple(t.shape) == tuple(shape) and _channels_last(t) for t in tensors)
    return Claimed(torch.empty(shape, dtype=dtype, device="meta",
                               memory_format=torch.channels_last if last else torch.contiguous_format))


def _convolution(x, w, bias, stride, padding, dilation, groups):
    out = torch.ops.aten.convolution(x, w, bias, stride, padding, dilation, False, [0] * len(stride), groups)
    return out.contiguous(memory_format=torch.channels_last) if _channels_last(x) or _channels_last(w) else out


def _channels_last(t: torch.Tensor) -> bool:
    """Whether `t` is laid out channels_last and not also contiguous (a 4-D tensor)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


# cuDNN's fused convolutions, which have no meta kernel (a walk on a machine whose torch has
# cuDNN reaches them): the plain convolution's result, channels_last where its input or filter
# is, as cuDNN's is
_CONVOLUTIONS = {
    torch.ops.aten.cudnn_convolution_relu.default: _convolution,
    torch.ops.aten.cudnn_convolution_add_relu.default:
        lambda x, w, z, alpha, bias, stride, padding, dilation, groups: _convolution(x, w, bias, stride, padding,
                                                                                    dilation, groups),
}


class _Storage:
    """A claimed tensor's storage as a load's code asks of it: where it starts, how long it is."""

    def __init__(self, address: int, nbytes: int):
        self.address, self._nbytes = address, nbytes

    def data_ptr(self) -> int:
        return self.address

    def nbytes(self) -> int:
        return self._nbytes


def _state() -> dict:
    state = _STATE.get()
    if state is None:  # a claimed tensor outside a walk (tests): a state of its own
        state = {"device": torch.device("cuda", 0), "bases": {}, "next": ADDRESS}
        _STATE.set(state)
    return state


def _base(meta: torch.Tensor) -> int:
    """A distinct, 512-byte aligned address per storage, as separate allocations have."""
    storage = meta.untyped_storage()
    state = _state()
    bases, key = state["bases"], storage._cdata
    if key not in bases:
        bases[key] = state["next"]
        state["next"] += -(-max(storage.nbytes(), 1) // ADDRESS) * ADDRESS + ADDRESS
    return bases[key]


def _meta(x):
    if isinstance(x, Claimed):
        return x.meta
    if isinstance(x, torch.device) and x.type == "cuda":
        return torch.device("meta")
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        return x.to("meta")
    return x


def _metas(x):
    """`x` with each claimed tensor its meta tensor, through lists and tuples: an aten op's
    arguments (torch's `tree_map`, which also takes dicts and named tuples, was a quarter of a walk's profile)."""
    if isinstance(x, Claimed):
        return x.meta
    if type(x) in (list, tuple):
        return type(x)(_metas(a) for a in x)
    return x


def _claim(x):
    return Claimed(x) if isinstance(x, torch.Tensor) and x.device.type == "meta" else x


def claimed(shape, dtype: torch.dtype, memory_format=torch.contiguous_format) -> Claimed:
    """A new claimed tensor (a root allocation)."""
    return Claimed(torch.empty(shape, dtype=dtype, device="meta", memory_format=memory_format))


FACTORIES = ("empty", "zeros", "ones", "full", "arange", "empty_strided", "tensor", "as_tensor", "rand", "randn",
             "linspace")


def _factory(make):
    """`make` (a torch factory) that makes a claimed tensor where it is asked for a CUDA device."""
    def made(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and walking() and torch.device(device).type == "cuda":  # this thread's walk only
            return _claim(make(*args, **{**kwargs, "device": "meta"}))
        return make(*args, **kwargs)
    return made


@contextlib.contextmanager
def _factories():
    """Within: torch's factories make claimed tensors for CUDA (patched by name: a function mode
    would see every torch call, ten times the walk's cost)."""
    saved = {name: getattr(torch, name) for name in FACTORIES}
    try:
        for name, make in saved.items():
            setattr(torch, name, _factory(make))
        yield
    finally:
        for name, make in saved.items():
            setattr(torch, name, make)


@contextlib.contextmanager
def walk(seen: list, device: torch.device):
    """Within: kernel launches are noted in `seen`, CUDA factories make claimed tensors, which
    claim `device`."""
    token = SEEN.set(seen)
    state = _STATE.set({"device": device, "bases": {}, "next": ADDRESS})
    try:
        with _factories():
            yield
    finally:
        SEEN.reset(token)
        _STATE.reset(state)
