"""Generated Triton kernels run on the CPU, for tests: the kernel's source is executed with a
stand-in for `triton` and `triton.language` built on torch, one program at a time.

The stand-in follows Triton where Triton differs from torch: `tl.maximum` and `tl.minimum` drop a
NaN operand (PTX's max.f32 does; Triton's default is not to propagate NaN), integer arithmetic
wraps at the index's width (int32 unless the source widens it), and a load or store outside its
buffer raises instead of reading or writing foreign memory.
"""

from __future__ import annotations

import types

import torch


class Pointer:
    """A tensor's storage as a flat buffer, plus element offsets."""

    def __init__(self, tensor: torch.Tensor, offsets=None):
        self.tensor = tensor
        self.flat = tensor.as_strided((tensor.untyped_storage().nbytes() // tensor.element_size()
                                       - tensor.storage_offset(),), (1,), tensor.storage_offset())
        self.offsets = offsets

    def __add__(self, offsets):
        p = Pointer.__new__(Pointer)
        offsets = torch.as_tensor(offsets)
        p.tensor, p.flat = self.tensor, self.flat
        p.offsets = offsets if self.offsets is None else self.offsets + offsets
        return p


def _checked(p: Pointer, mask):
    o = p.offsets[mask]
    if len(o) and (o.min() < 0 or o.max() >= len(p.flat)):
        raise IndexError(f"offset {int(o.min())}..{int(o.max())} outside a buffer of {len(p.flat)} elements")
    return o


class _Program:
    pid: tuple[int, ...] = (0,)  # the program's id along each axis of the grid


def language() -> types.ModuleType:
    tl = types.ModuleType("triton.language")
    tl.float32, tl.float16, tl.bfloat16, tl.int64 = torch.float32, torch.float16, torch.bfloat16, torch.int64
    tl.constexpr = int
    tl.program_id = lambda axis: torch.tensor([_Program.pid[axis]], dtype=torch.int32)  # 1-D: promotes as Triton does
    tl.zeros = lambda shape, dtype: torch.zeros(shape, dtype=dtype)
    tl.arange = lambda start, end: torch.arange(start, end, dtype=torch.int32)
    tl.full = lambda shape, value, dtype: torch.full(shape, value, dtype=dtype)
    tl.static_range = range

    def load(p, mask=None, other=0):
        mask = torch.ones_like(p.offsets, dtype=torch.bool) if mask is None else mask
        out = torch.full(p.offsets.shape, other, dtype=p.flat.dtype)
        out[mask] = p.flat[_checked(p, mask)]
        return out

    def store(p, value, mask=None):
        mask = torch.ones_like(p.offsets, dtype=torch.bool) if mask is None else mask
        value = torch.as_tensor(value).expand(p.offsets.shape)  # a scalar (a row's sum) stored at one offset
        p.flat[_checked(p, mask)] = value[mask].to(p.flat.dtype)

    tl.load, tl.store = load, store
    def where(condition, x, y):
        if isinstance(condition, bool):  # a loop's own counter: a scalar choice
            return x if condition else y
        if isinstance(x, Pointer) or isinstance(y, Pointer):  # one program's choice of buffer
            return x if bool(condition.all()) else y
        return torch.where(condition, x, y)

    tl.where = where
    tl.sum = lambda x, axis: x.sum(axis)
    tl.max = lambda x, axis: x.max(axis).values
    tl.trans = lambda x: x.transpose(0, 1)
    # float32 products in float64, rounded once (input_precision="ieee"); half precision as the tensor cores take it
    def dot(a, b, acc=None, input_precision=None):
        product = (a.double() @ b.double()).float()
        return product if acc is None else acc + product

    tl.dot = dot

    def inline_asm_elementwise(asm, constraints, args, dtype, is_pure, pack):
        """The one instruction generated kernels use: float32 rounded to the nearest TF32 value,
        ties away from zero (`cvt.rna.tf32.f32`): the magnitude's 13 low bits rounded off."""
        assert asm == "cvt.rna.tf32.f32 $0, $1;" and constraints == "=r,r" and dtype == torch.float32, asm
        (x,) = args
        bits = x.contiguous().view(torch.int32)
        rounded = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
        return torch.where(torch.isfinite(x), rounded, x)

    tl.inline_asm_elementwise = inline_asm_elementwise
    tl.maximum, tl.minimum = torch.fmax, torch.fmin  # NaN-dropping, as Triton's default
    tl.sigmoid, tl.exp, tl.sqrt, tl.rsqrt, tl.abs, tl.erf = (torch.sigmoid, torch.exp, torch.sqrt, torch.rsqrt,
                                                           torch.abs, torch.erf)
    return tl


def run(source: str, out: torch.Tensor, operands: list[torch.Tensor], block: int) -> None:
    """Execute the generated kernel `source` over `out` and `operands`, as `generated.elementwise_launcher`'s
    launcher would, on the CPU."""
    triton = types.ModuleType("triton")
    triton.jit = lambda fn: fn
    tl = language()
    namespace = {"triton": triton, "tl": tl}  # int32 tensors wrap around on overflow, as on the GPU
    code = source.replace("import triton.language as tl", "").replace("import triton", "")
    exec(compile(code, "<kernel>", "exec"), namespace)
    kernel = namespace["kernel"]
    numel = out.numel()
    for pid in range((numel + block - 1) // block):
        _Program.pid = (pid,)
        kernel(Pointer(out), *(Pointer(t) for t in operands), N=numel, BLOCK=block)


def run_grid(source: str, grid: int | tuple[int, ...], *args, **constants) -> None:
    """Execute the kernel `source` defines once per program id in the grid (`grid` programs, or
    a tuple of programs per axis), with tensor arguments as pointers, as `kernel[grid](*args,
    **constants)` would on the GPU."""
    import itertools

    triton = types.ModuleType("triton")
    triton.jit = lambda fn: fn
    namespace = {"triton": triton, "tl": language()}
    code = source.replace("import triton.language as tl", "").replace("import triton", "")
    exec(compile(code, "<kernel>", "exec"), namespace)
    constants.pop("num_warps", None)
    constants.pop("num_stages", None)
    for pid in itertools.product(*(range(g) for g in (grid if isinstance(grid, tuple) else (grid,)))):
        _Program.pid = pid
        namespace["kernel"](*(Pointer(a) if isinstance(a, torch.Tensor) else a for a in args), **constants)
