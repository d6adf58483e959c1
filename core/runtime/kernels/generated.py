"""The generated-kernel machinery every kernel module shares: `define` turns source text that
`codegen.py` (or a kernel module) generated into a `Generated` kernel, launched as Triton launches
one, from a recalled binary where an earlier process left one (`binaries.py`); `launch_once`
builds a launcher on its first call and falls back (None) where that fails; `STATS` counts what
was built, what the cache folder already held, and what fell back."""

from __future__ import annotations

import hashlib
import linecache
import math
import time
from dataclasses import dataclass, field

import torch

from ...errors import first_line
from ..base import cache, claimed
from . import binaries
from .codegen import BLOCK, ConcatTiles

MAX_NORM_ROW = 2**14  # elements of one normalised row that one program keeps in registers
FLOAT_KINDS = (torch.float32, torch.float16, torch.bfloat16)


def triton_block(n: int) -> int:
    """The power of two at least `n` (and at least 16) that a row's program spans."""
    return max(16, 1 << (n - 1).bit_length())


def row_warps(block: int) -> int:
    """The warps of a program that keeps a row of `block` elements in registers."""
    return min(16, max(1, block // 256))


@dataclass
class KernelStats:
    generated: int = 0  # kernels built in this process
    source_hits: int = 0  # of which the source was already in the cache folder
    fallbacks: list[str] = field(default_factory=list)  # bodies interpreted instead, and why
    seconds: float = 0.0
    compiled: int = 0  # launches Triton compiled here, as they ran (no binary recalled or taken from a pack)


STATS = KernelStats()

@dataclass
class NormAfter:
    """The layer norm (aten::layer_norm over each row's last dims, `shape`) that reads a fused op's
    result, run in that op's kernel: `out` its planned buffer, `store` whether anything else reads
    the fused result (GPT-2's residual stream: yes; BERT's post-norm sum: no)."""

    shape: tuple
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float
    out: torch.Tensor
    store: bool

    @property
    def n(self) -> int:
        return math.prod(self.shape)

    def fits(self, x: torch.Tensor) -> bool:
        """Row-major input and output of one floating dtype, normalised over its last dims, rows of
        at most MAX_NORM_ROW elements, and a weight and bias dense over a row."""
        if not (x.is_cuda and self.out.is_cuda and x.dtype in FLOAT_KINDS and self.out.dtype == x.dtype
                and 0 < self.n <= MAX_NORM_ROW
                and tuple(self.out.shape) == tuple(x.shape) and x.dim() >= len(self.shape)
                and tuple(x.shape[x.dim() - len(self.shape):]) == tuple(self.shape)
                and x.is_contiguous() and self.out.is_contiguous()):
            return False
        return all(t is None or (t.is_cuda and t.dtype in FLOAT_KINDS and t.numel() == self.n and t.is_contiguous())
                   for t in (self.weight, self.bias))


_UNBUILT = object()


def launch_once(built: dict, key: tuple, build, args: tuple, who: str) -> bool:
    """Run the launcher for `key` (a call signature) in `built` on `args`, built by `build()` on
    its first use; False where that first build or launch fails (no Triton, or a body it cannot
    compile): `STATS` records why under `who`, and `built[key]` is None from then on."""
    launch = built.get(key, _UNBUILT)
    if launch is None:
        return False
    if launch is not _UNBUILT:
        launch(*args)
        return True
    t = time.perf_counter()
    try:  # the first launch compiles: a failure there falls back too
        launch = build()
        launch(*args)
    except Exception as e:
        STATS.fallbacks.append(f"{who}: {type(e).__name__}: {first_line(e)}")
        launch = None
    STATS.seconds += time.perf_counter() - t
    built[key] = launch
    return launch is not None


def define(source: str) -> Generated:
    """The `kernel` that generated `source` defines, launched as a Triton kernel is
    (`kernel[grid](*args, **constants)`, see `Generated`); a copy of the text goes to the cache
    folder for reading, never to be imported."""
    digest = hashlib.sha256(f"{source}triton {binaries.triton_version()}".encode()).hexdigest()[:32]
    folder = cache.cache_dir("kernels")
    if folder is not None:
        path = folder / f"k{digest}.py"
        if cache.read_small(path, len(source.encode())) == source.encode():
            STATS.source_hits += 1
        else:
            cache.write(path, source.encode())
    STATS.generated += 1
    return Generated(source, digest)


class Generated:
    """A generated kernel. A launch whose call signature met a binary before runs it without
    Triton (`binaries.recall`). For any other Triton compiles the text (Triton reads a kernel's
    source through `inspect`, so the text is registered with `linecache` under a name no file
    has); its binary is recorded for later loads (`binaries.remember`) and launched as a recalled
    one is. Where it cannot be recorded or loaded, Triton launches it."""

    def __init__(self, source: str, digest: str):
        self.source, self.digest = source, digest
        self._jit = None
        self._binaries: dict[str, binaries.Binary | None] = {}  # call signature -> recorded binary, or None
        self._recorded: set[str] = set()  # signatures Triton built and `remember` saw in this process

    def __getitem__(self, grid: tuple):
        return lambda *args, **constants: self.launch(tuple(grid), args, constants)

    def launch(self, grid: tuple, args: tuple, constants: dict) -> None:
        seen = claimed.SEEN.get()
        if seen is not None:  # a prebuild's walk (`runtime/prebuild.py`): noted, never launched
            seen.append((self, args, constants))
            return
        signature = binaries.specialisation(args, constants)
        if signature not in self._binaries:
            self._binaries[signature] = binaries.recall(self.digest, signature, args, constants)
        binary = self._binaries[signature]
        if binary is not None:
            binary.run(grid, args, constants)
            return
        jit = self.jit()
        if signature not in self._recorded:
            # Triton builds it and launches nothing (`warmup`); the binary runs through the static
            # launcher, so Triton's own launcher (a C module per signature) is never compiled
            self._recorded.add(signature)
            STATS.compiled += 1
            compiled = jit.warmup(*args, grid=grid, **constants)
            binary = binaries.remember(self.digest, signature, compiled, args, constants, list(jit.arg_names))
            self._binaries[signature] = binary
            if binary is not None:
                binary.run(grid, args, constants)
                return
        jit[grid](*args, **constants)

    def jit(self):
        """The Triton kernel, compiled from this text on first use."""
        if self._jit is None:
            import triton  # noqa: F401 - fails here, where Triton is missing, and the caller falls back

            filename = f"<nimble kernel k{self.digest}>"
            linecache.cache[filename] = (len(self.source), None, self.source.splitlines(keepends=True), filename)
            namespace = {"__name__": f"nimble_kernel_{self.digest}"}
            exec(compile(self.source, filename, "exec"), namespace)  # noqa: S102 - text generated in this process
            self._jit = namespace["kernel"]
        return self._jit


def norm_launcher(source: str):
    """A launcher for `norm_source`'s kernel: one program per row."""
    kernel = define(source)

    def launch(out: torch.Tensor, operands: list[torch.Tensor], norm: NormAfter) -> None:
        block = triton_block(norm.n)
        kernel[(out.numel() // norm.n,)](out, norm.out, out if norm.weight is None else norm.weight,
                                         out if norm.bias is None else norm.bias, *operands, float(norm.eps),
                                         N=norm.n, BLOCK=block, num_warps=row_warps(block))

    return launch


def concat_launcher(source: str, tiles: ConcatTiles):
    """A launcher for `concat_source`'s kernel: one program per tile."""
    kernel = define(source)

    def launch(out: torch.Tensor, pieces: list[torch.Tensor], operands: list[torch.Tensor]) -> None:
        kernel[(tiles.programs,)](out, *pieces, *operands)

    return launch


def elementwise_launcher(source: str):
    """A launcher for the generated elementwise source (`define`)."""
    kernel = define(source)

    def launch(out: torch.Tensor, operands: list[torch.Tensor]) -> None:
        numel = out.numel()
        kernel[(-(-numel // BLOCK),)](out, *operands, N=numel, BLOCK=BLOCK)

    return launch


class FixedKernel:
    """A kernel of fixed source, built on its first launch through `generated.define` (cached and
    counted as every generated kernel is). Where that first launch fails, `STATS` records
    why and every launch declines from then on, so PyTorch computes the op."""

    def __init__(self, source: str, what: str):
        self.source, self.what, self.kernel, self.failed = source, what, None, False

    def launch(self, grid: tuple, *args, **constants) -> bool:
        """Run it over `grid`; False where it cannot be built."""
        if self.failed:
            return False
        first = self.kernel is None
        t = time.perf_counter()
        try:
            if first:
                self.kernel = define(self.source)
            self.kernel[grid](*args, **constants)
        except Exception as e:
            if not first:
                raise
            STATS.fallbacks.append(f"{self.what}: {type(e).__name__}: {first_line(e)}")
            self.failed = True
            return False
        finally:
            if first:
                STATS.seconds += time.perf_counter() - t
        return True
