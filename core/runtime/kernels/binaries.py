"""Generated kernels launched from the binary Triton built in an earlier process, without Triton.

The first launch of a Triton kernel in a process costs about 0.8 s on the H100 box before the
kernel runs: importing Triton, then Triton's cache key, which hashes Triton's own library, then
its launcher. A load whose kernels were all built before needs none of that:

- After Triton compiles a generated kernel (`generated.Generated`, through Triton's `warmup`, which
  launches nothing), `remember` writes a record to the cache folder (`binaries/`, one small JSON
  file per kernel and call signature). It names the binary Triton keeps in its own cache folder
  (path, size and sha256), the kernel's entry point, warps and shared memory, and which of the
  call's arguments the binary takes, in which C type. The binary is loaded at once and launched
  as a recalled one is, so Triton's own launcher is never built: Triton compiles it from C with
  the system compiler, once per argument signature, 0.35 s each on the H100 box.
- A later launch with the same signature (`recall`) reads that record, checked as every cache
  file is, reads the binary (a regular file of the recorded size whose sha256 matches), and loads
  it through torch's static CUDA launcher (`torch._C._StaticCudaLauncher`, with which Inductor
  launches its own Triton kernels). Triton is not imported.
- Anything amiss (no record, a record that does not check, a binary that is gone or changed, a
  torch without the launcher, a load that fails) is a miss: Triton launches the kernel as before.

The signature (`specialisation`) names everything Triton may specialise a binary on, and more:
each tensor's dtype, device and whether its address is 16-byte aligned, and the exact value of
every other argument and launch option. So two calls with one signature can share one binary.
The record's key adds the kernel's source digest, the Triton and torch versions and the GPU's
compute capability.

nimble's cache folder still holds no code: the binary executed is the one Triton compiled and
would itself load from its cache, and only if its digest is the one seen when Triton built it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from ..base import cache
from ..base import settings

RECORD_LIMIT = 16 * 1024  # bytes of one record
BINARY_LIMIT = 64 * 2**20  # bytes of one compiled kernel
MAX_SHARED = 256 * 1024  # bytes of shared memory a kernel may ask for (the H100 has 228 KiB)
C_TYPES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H",
           "u32": "I", "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f", "f32": "f", "fp64": "d"}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,200}")
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass
class Stats:
    recalled: int = 0  # kernels launched from a recorded binary, without Triton
    remembered: int = 0  # records written after Triton built a kernel


STATS = Stats()
_LOADED: dict[tuple, int] = {}  # (sha256, entry, shared bytes, device index) -> the loaded function
# record path -> a record this process wrote, or read and checked with its binary: a later launch
# (the load after its prebuild, another candidate) takes it without reading and hashing again
_READY: dict[Path, dict] = {}
# kernel packs the user trusted in this process (`pack.py`, `trust`)
_TRUSTED: list = []


def specialisation(args: tuple, constants: dict) -> str:
    """The call's signature as a binary depends on it (see the module docstring)."""
    return ";".join(f"{slot}={_describe(v)}" for slot, v in [*enumerate(args), *constants.items()])


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"*{v.dtype}@{v.device.type}:{v.data_ptr() % 16 == 0}"  # one binary serves every GPU of a kind
    if isinstance(v, (bool, int, float, str)) or v is None:
        return f"{type(v).__name__}:{v!r}"
    return f"?{type(v).__name__}"  # nothing a generated kernel passes: never recorded, see `remember`


def triton_version() -> str | None:
    """Triton's version without importing it (an imported Triton says its own); None if missing."""
    module = sys.modules.get("triton")
    if module is not None:
        return getattr(module, "__version__", None)
    return _installed_triton()


@lru_cache(maxsize=1)
def _installed_triton() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def _launcher():
    return getattr(torch._C, "_StaticCudaLauncher", None)


def _record_path(digest: str, signature: str, device: torch.device) -> Path | None:
    folder = cache.cache_dir("binaries")
    if folder is None:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    key = f"{digest}|triton {triton_version()}|torch {torch.__version__}|sm {major}{minor}|{signature}"
    return folder / f"b{hashlib.sha256(key.encode()).hexdigest()[:40]}.json"


def enabled(device: torch.device) -> bool:
    """Whether recorded binaries can serve launches on `device` (see `_device`)."""
    return device.type == "cuda" and settings.current().recalled_binaries and _launcher() is not None \
        and triton_version() is not None


def _device(args: tuple, constants: dict) -> torch.device | None:
    """The one CUDA device the call's tensors are on, where recorded binaries can serve the call
    (enabled, torch has the static launcher, Triton is installed); else None."""
    devices = {v.device for v in [*args, *constants.values()] if isinstance(v, torch.Tensor)}
    if len(devices) != 1:
        return None
    (device,) = devices
    return device if enabled(device) else None


class Binary:
    """A compiled kernel loaded through torch's static launcher; `run` launches it on the current
    stream (inside a capture too)."""

    def __init__(self, record: dict, device: torch.device):
        key = (record["sha256"], record["name"], record["shared"], device.index or 0)
        if key not in _LOADED:  # a process loads each binary once, however many executables launch it
            got = _launcher()._load_kernel(record["binary"], record["name"], record["shared"], device.index or 0)
            _LOADED[key] = got[1] if len(got) == 4 else got[0]  # newer torch returns the module first
        self.function = _LOADED[key]
        self.record, self.device = record, device
        self.slots = [s if isinstance(s, int) else str(s) for s, _ in record["params"]]
        self.types = "".join(t for _, t in record["params"]) + "O" * record["scratch"]

    def run(self, grid: tuple, args: tuple, constants: dict) -> None:
        gx, gy, gz = (*grid, 1, 1)[:3]
        if gx * gy * gz <= 0:
            return
        values = tuple(args[s] if isinstance(s, int) else constants[s] for s in self.slots)
        _launcher()._launch_kernel(self.function, gx, gy, gz, self.record["num_warps"], self.record["shared"],
                                   self.types, values + (None,) * self.record["scratch"],
                                   torch.cuda.current_stream(self.device).cuda_stream)


def recall(digest: str, signature: str, args: tuple, constants: dict) -> Binary | None:
    """The binary recorded for this kernel and signature, else a trusted pack's (`trust`), loaded;
    None on any miss."""
    device = _device(args, constants)
    if device is None:
        return None
    path = _record_path(digest, signature, device)
    record = _READY.get(path) if path is not None else None
    if record is None or not fits(record, args, constants):
        record = read_record(path, args, constants) if path is not None else None
        data = cache.read_small(Path(record["binary"]), record["size"]) if record is not None else None
        if data is None or len(data) != record["size"] or hashlib.sha256(data).hexdigest() != record["sha256"]:
            return _from_trusted(digest, signature, args, constants, device)
        _READY[path] = record
    try:
        binary = Binary(record, device)
    except Exception:  # a driver that refuses the binary: Triton builds it again
        return None
    STATS.recalled += 1
    return binary


def trust(pack):
    """Let every later launch in this process that the cache folder has no binary for take one
    from `pack` (a `pack.Pack` the user trusted, which checks each binary against the launch and
    keeps it in the cache folder). A load whose pack covers it (`Pack.covers`) does this instead
    of walking its op lists (`prebuild.py`). Returns the pack that serves: one trusted before from
    the same file with the same manifest (another batch size's load, a second load), else `pack`."""
    for known in _TRUSTED:
        if known.path == pack.path and known.manifest == pack.manifest:
            return known
    _TRUSTED.append(pack)
    return pack


def _from_trusted(digest: str, signature: str, args: tuple, constants: dict, device: torch.device) -> Binary | None:
    for pack in _TRUSTED:
        binary = pack.take(digest, signature, args, constants, device)
        if binary is not None:
            STATS.recalled += 1
            return binary
    return None


def read_record(path: Path, args: tuple, constants: dict) -> dict | None:
    """The record at `path` if it is one this call can use: every field of the type and range
    nimble writes, its parameters naming arguments this call has, of the C types their values
    can be passed as. None otherwise."""
    data = cache.read_small(path, RECORD_LIMIT)
    try:
        record = json.loads(data) if data is not None else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("binary"), str) \
            or not os.path.isabs(record["binary"]) or "\0" in record["binary"]:
        return None
    return record if fits(record, args, constants) else None


def fits(record, args: tuple, constants: dict) -> bool:
    """Whether `record` (where the binary lies aside) is one this call can use: every field of
    the type and range nimble writes, its parameters naming arguments this call has, of the C
    types their values can be passed as."""
    return _fits(record, args, constants) is not None


def _fits(record, args: tuple, constants: dict) -> dict | None:
    if not isinstance(record, dict) or record.get("version") != 1:
        return None
    ints = ("size", "num_warps", "shared", "scratch")
    if not all(type(record.get(k)) is int for k in ints) or not all(isinstance(record.get(k), str)
                                                                      for k in ("sha256", "name")):
        return None
    if not (0 < record["size"] <= BINARY_LIMIT and record["num_warps"] in (1, 2, 4, 8, 16, 32)
            and 0 <= record["shared"] <= MAX_SHARED and 0 <= record["scratch"] <= 2
            and _DIGEST.fullmatch(record["sha256"]) and _NAME.fullmatch(record["name"])):
        return None
    params = record.get("params")
    if not isinstance(params, list) or len(params) > 64:
        return None
    for param in params:
        if not (isinstance(param, list) and len(param) == 2 and param[1] in set(C_TYPES.values()) | {"O"}):
            return None
        slot, kind = param
        if type(slot) is int:
            if not 0 <= slot < len(args):
                return None
            value = args[slot]
        elif isinstance(slot, str) and slot in constants:
            value = constants[slot]
        else:
            return None
        if (kind == "O") != isinstance(value, torch.Tensor) or (kind in "fd" and not isinstance(value, float)) \
                or (kind not in "Ofd" and not isinstance(value, int)):
            return None
    return record


def remember(digest: str, signature: str, compiled, args: tuple, constants: dict, arg_names: list[str]) -> Binary | None:
    """Record the binary Triton just built for this call (see the module docstring) and load it
    for this process's next launches; None where it cannot be described, found or loaded (the
    kernel then stays Triton's)."""
    device = _device(args, constants)
    if device is None or "?" in signature:
        return None
    try:
        record = _describe_compiled(compiled, args, constants, arg_names)
    except Exception:  # a Triton whose compiled kernels look otherwise
        return None
    return None if record is None else _keep(digest, signature, record, device)


def _describe_compiled(compiled, args: tuple, constants: dict, arg_names: list[str]) -> dict | None:
    """The record of Triton's `CompiledKernel` for this call, its binary where Triton keeps it
    in its cache folder; None where the static launcher cannot run it or the binary is not there."""
    from triton.runtime.cache import get_cache_manager

    described = describe(compiled, args, constants, arg_names)
    if described is None:
        return None
    record, binary = described
    path = Path(get_cache_manager(compiled.hash).cache_dir) / f"{record['name']}.cubin"
    if cache.read_small(path, BINARY_LIMIT) != binary:
        return None
    return {**record, "binary": str(path.resolve())}


def install(digest: str, signature: str, record: dict, binary: bytes, device: torch.device) -> Binary | None:
    """Keep `binary` (a checked kernel pack's, `pack.py`) in the cache folder with its record, as
    if Triton had built it here, and load it; None where the cache folder cannot hold it."""
    folder = cache.cache_dir("binaries")
    if folder is None:
        return None
    path = folder / f"c{record['sha256']}.cubin"
    if cache.read_small(path, BINARY_LIMIT) != binary and not cache.write(path, binary):
        return None
    return _keep(digest, signature, {**record, "binary": str(path.resolve())}, device)


def _keep(digest: str, signature: str, record: dict, device: torch.device) -> Binary | None:
    path = _record_path(digest, signature, device)
    if path is None:
        return None
    cache.write(path, json.dumps(record, indent=1).encode())
    _READY[path] = record
    STATS.remembered += 1
    try:
        return Binary(record, device)
    except Exception:
        return None


def describe(compiled, args: tuple, constants: dict, arg_names: list[str]) -> tuple[dict, bytes] | None:
    """The record (all but where the binary lies) of Triton's `CompiledKernel` for this call, and
    its binary; None where the static launcher cannot run it (several CTAs, scratch memory)."""
    meta = compiled.metadata
    if getattr(meta, "num_ctas", 1) != 1:
        return None
    scratch = 0
    for size in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(meta, size):
            if getattr(meta, size):
                return None
            scratch += 1
    binary = compiled.asm.get("cubin") if isinstance(compiled.asm, dict) else None
    if not isinstance(binary, bytes) or not 0 < len(binary) <= BINARY_LIMIT:
        return None
    src = compiled.src
    constant_slots = {key[0] if isinstance(key, tuple) else key for key in getattr(src, "constants", {})}
    params = []
    for key, kind in src.signature.items():
        index = arg_names.index(key) if isinstance(key, str) else int(key)
        if kind == "constexpr" or index in constant_slots or arg_names[index] in constant_slots:
            continue
        slot = index if index < len(args) else arg_names[index]
        if not isinstance(slot, int) and slot not in constants:
            return None  # a parameter left at its default: not one generated kernels have
        params.append([slot, "O" if kind.startswith("*") else C_TYPES[kind]])
    shared = getattr(compiled, "shared", None)
    return ({"version": 1, "size": len(binary), "sha256": hashlib.sha256(binary).hexdigest(), "name": meta.name,
             "num_warps": meta.num_warps, "shared": int(shared if shared is not None else meta.shared),
             "scratch": scratch, "params": params}, binary)
