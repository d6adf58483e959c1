"""What a load may do and the thresholds of its measured choices, as one frozen value
(DESIGN.md, "Settings are data").

`Settings()` is what nimble runs with. A benchmark or a test that wants another builds one
(`Settings(gemm_kernel=False)`, or `Settings.parse(["gemm_slower=1.1"])` from a command line) and
passes it to `load(..., settings=)`; nothing is patched. The load makes it current for the kernels
while it builds, warms up and captures (`using`), as tinygrad's `Context(BEAM=2)` does, and every
cache that keeps a measured choice keys it by `digest()`: the tuning cache, the kernel choices
(`kernels/recall.py`) and the cuDNN plans (`kernels/cudnn_graph.py`). A choice timed under one
setting is never read under another. The default settings digest to "" so the caches written
before they existed stay valid.

Limits that guard against a hostile file (record and table sizes) and the geometry of a kernel's
tiles are not settings: they stay constants of their modules.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import hashlib
import json
from dataclasses import dataclass, fields, replace

from ...errors import UsageError


@dataclass(frozen=True)
class Settings:
    # kernels of nimble's own (False: PyTorch's way, or the ops apart; for comparisons)
    recalled_binaries: bool = True  # launch a kernel built by an earlier process without Triton
    gemm_kernel: bool = True  # float32 products as a generated kernel where measured faster
    attention_kernel: bool = True  # small attention as one generated kernel
    pooled_kernel: bool = True  # a 1x1 convolution of a 1x1 map (and a linear of few rows) generated
    depthwise_kernel: bool = True  # a depthwise convolution and its body generated
    pointwise_kernel: bool = True  # a 1x1 convolution computing its input's elementwise op as it loads
    average_pool_kernel: bool = True  # average pooling generated
    channels_norm_kernel: bool = True  # a layer norm over a channels-first map's channels generated (`kernels/norms.py`)
    standalone_pointwise: bool = True  # a lone 1x1 convolution's body as one generated product, where faster
    bare_convolution_graphs: bool = True  # a generated body's convolution as a cuDNN graph where one was chosen
    early_builders: bool = True  # a cold load starts its build processes beside its walk (`kernels/aot.Builders`)
    # load-time pairs (`runtime/pairs/`)
    mean_pairs: bool = True
    depthwise_mean_pairs: bool = True  # a depthwise-led op's mean too (False: the depthwise kernel, the mean apart)
    product_pairs: bool = True
    scatter_pairs: bool = True
    prologue_pairs: bool = True
    input_pairs: bool = True
    max_views: int = 4  # views between a product and the copy a scatter pair takes it through
    # measured choices: a kernel runs where it takes at most `*_slower` times the other way,
    # and agrees with it within `*_tolerance` (relative to the largest magnitude)
    gemm_slower: float = 1.0
    gemm_tolerance: float = 1e-4
    attention_slower: float = 1.0
    attention_tolerance: float = 1e-3
    attention_half_tolerance: float = 2e-2
    pointwise_slower: float = 1.0
    pointwise_tolerance: float = 1e-2
    prologue_slower: float = 1.0  # a depthwise prologue pair against its two ops run whole
    fused_candidate_rows: int = 256  # conv -> add -> relu split by cuDNN, with at most these rows, is timed too
    max_pooled_products: int = 2**24  # N x C' x C multiply-adds of a generated 1x1-map convolution
    max_depthwise_taps: int = 49
    max_pool_window: int = 256
    # cuDNN graphs (`kernels/cudnn_graph.py`)
    cudnn_plans: int = 5  # precompiled plans tried per convolution, in cuDNN's heuristic order
    cudnn_compiled_plans: int = 3  # runtime-compiled plans tried for conv -> bias -> add -> relu
    cudnn_max_workspace: int = 16 * 2**20
    cudnn_slower: float = 1.03  # a plan is used while at most this much slower than the reference
    cudnn_slower_outside: float = 1.25  # ... or this much, where the reference's result lies outside the arena
    cudnn_slower_large_outside: float = 1.5  # ... or this much, where that result is `cudnn_large_block` or more
    cudnn_large_block: int = 2**20
    cudnn_tolerance: float = 1e-2
    cudnn_too_slow_s: float = 0.05  # a plan whose checked run alone takes longer (and `cudnn_too_slow` times
    cudnn_too_slow: float = 20  # the limit) is not timed
    # the tuning search (`tune/choices.py`): a candidate this much slower than the fastest may win
    # where its graph pool holds at least `memory_worth` bytes less
    memory_slack: float = 0.02
    memory_worth: int = 8 * 2**20
    # cuDNN's benchmarked algorithms win only where they take at most this times the best other
    # candidate: unlike every other choice they cost again in each process that loads (cuDNN
    # searches every convolution's algorithms once per process; resnet50's warm load on the H200
    # took 2.6 s with them, 1.2 s without)
    benchmark_slower: float = 0.98
    # where cuDNN graphs can run, contiguous is first timed without cuDNN's plan search, and timed
    # with it only where it then took at most this times channels_last's time (`tune/search.py`)
    provisional_layout: float = 1.3

    def __post_init__(self):
        for f in fields(self):
            value, kind = getattr(self, f.name), type(f.default)
            if kind is bool:
                ok = type(value) is bool
            elif kind is int:
                ok = type(value) is int and value >= 0
            else:  # a float (an int too): a test may ask for inf (any plan) or a negative tolerance (none)
                ok = type(value) in (int, float) and value == value
            if not ok:
                what = "True or False" if kind is bool else ("a whole number, 0 or more" if kind is int else "a number")
                raise UsageError(f"setting {f.name} must be {what}, got {value!r}")

    def changed(self) -> dict:
        """The settings that differ from the defaults, by name."""
        default = Settings()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}

    def digest(self) -> str:
        """"" for the defaults, else a short hash of what differs: part of every cache key."""
        changed = self.changed()
        return "" if not changed else hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.changed().items()) or "defaults"

    @classmethod
    def parse(cls, texts) -> Settings:
        """Settings from `NAME=VALUE` texts (a Python literal each), as a command line gives them."""
        names = {f.name for f in fields(cls)}
        changes = {}
        for text in texts:
            name, sep, value = text.partition("=")
            name = name.strip()
            if not sep or name not in names:
                raise UsageError(f"{text!r} names no setting; expected NAME=VALUE with NAME one of "
                                 f"{', '.join(sorted(names))}")
            try:
                changes[name] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                raise UsageError(f"{text!r}: the value must be a Python literal (True, 1.05, 4096)") from None
        return replace(cls(), **changes)


DEFAULT = Settings()
_current: contextvars.ContextVar[Settings] = contextvars.ContextVar("nimble_settings", default=DEFAULT)


def current() -> Settings:
    """The settings of the load running on this thread (the defaults outside one)."""
    return _current.get()


@contextlib.contextmanager
def using(settings: Settings | None):
    """Make `settings` current for the kernels while the block runs (None: leave them as they are)."""
    if settings is None:
        yield current()
        return
    token = _current.set(settings)
    try:
        yield settings
    finally:
        _current.reset(token)
