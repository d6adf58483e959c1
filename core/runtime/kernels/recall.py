"""Per-call kernel choices measured at load, kept in the cache folder (`kernel_choices.json`).

Some generated kernels are taken per call signature by measurement on its first call (a 1x1
convolution's tile, or the two ops run apart: `pointwise_conv.Choices`; a depthwise prologue
kept or not: `FusedKernel._prologue_kept`; a wide depthwise filter on the generated kernel or
cuDNN's: `depthwise_conv.Wide`; a float32 product's tile, or PyTorch's product:
`gemm.Gemm._choose`; attention's tile, or PyTorch's attention: `small_attention.Attention._choose`).
Measured at every load, each costs builds and CUDA graph timings (seconds for densenet121's 61
pairs), and two loads of one artifact could choose differently where the two ways time alike.
The choice is kept here, keyed by the call's signature, the settings the choice depends on, the
GPU, torch's and Triton's versions and nimble's runtime code (a choice measured on other kernel
text is not reused), so a later load takes it without timing and builds only what it runs.

The file may be crafted like any cache file (`cache.py`): an entry is recalled only in the
shape its caller expects (a tile among the known ones in integers, a boolean), and a recalled
kernel is still checked against the ops it replaces before it runs; a crafted entry can only make
a load slower. Nothing is kept on a machine without CUDA (the CPU tests drive these paths with tensors
that only claim to be on CUDA).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

import torch

from ..base import cache, settings
from ..base.claimed import walking
from .binaries import triton_version

MAX_TABLE_BYTES = 4 * 2**20  # a few thousand entries; the older half goes past it (`cache.write_entry`)
TABLE = "kernel_choices.json"


@lru_cache(maxsize=1)
def runtime_code() -> str:
    """A digest of nimble's runtime sources: the kernels' text and the way they are chosen."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _where(device: torch.device) -> tuple | None:
    """The GPU and software a choice was measured on; None without CUDA, and in a prebuild's
    walk (which measures nothing: it tries every candidate)."""
    if walking() or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    return (props.name, props.major, props.minor, torch.__version__, triton_version(), runtime_code(),
            settings.current().digest())  # a choice measured under other thresholds is not this one


def _entry_key(kind: str, key: tuple, device: torch.device) -> str | None:
    where = _where(device)
    return None if where is None else hashlib.sha256(repr((kind, where, key)).encode()).hexdigest()


def _path() -> Path | None:
    folder = cache.cache_dir()
    return None if folder is None else folder / TABLE


def recalled(kind: str, key: tuple, device: torch.device) -> dict | None:
    """The entry kept for this `kind` of choice and call `key` on this device, or None."""
    entry_key = _entry_key(kind, key, device)
    if entry_key is None:
        return None
    entry = cache.read_table(_path(), MAX_TABLE_BYTES).get(entry_key)
    return entry if isinstance(entry, dict) else None


def keep(kind: str, key: tuple, device: torch.device, entry: dict) -> None:
    """Keep `entry` (JSON) for this `kind` of choice and call `key` on this device."""
    entry_key = _entry_key(kind, key, device)
    if entry_key is not None:
        cache.write_entry(_path(), entry_key, entry, MAX_TABLE_BYTES)


def kept_tile(kind: str, key: tuple, device: torch.device, tiles) -> tuple | None | bool:
    """The tile kept for this call, where it is one of `tiles`; None where the other way was
    kept (PyTorch's, or the ops apart); False where nothing usable was kept."""
    entry = recalled(kind, key, device)
    tile = entry.get("tile", False) if entry is not None else False
    if tile is None:
        return None
    return tuple(tile) if known_tile(tile, tiles) else False


def keep_tile(kind: str, key: tuple, device: torch.device, tile: tuple | None) -> None:
    """Keep the tile chosen for this call, or None for the other way (`kept_tile` reads it)."""
    keep(kind, key, device, {"tile": None if tile is None else list(tile)})


def known_tile(kept, tiles) -> bool:
    """Whether a recalled entry's `kept` is one of `tiles`, written as a list of integers (a
    float that hashes like an integer is not one)."""
    return isinstance(kept, list) and all(type(v) is int for v in kept) and tuple(kept) in tiles
