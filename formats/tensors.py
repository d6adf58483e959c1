"""safetensors members, checked before a single tensor is allocated.

The checks mirror safetensors' own: a capped header; known dtypes; every tensor's byte range
matching its shape; ranges sorted, contiguous, non-overlapping and covering the data exactly.
"""

from __future__ import annotations

import json
import math
import struct

import torch

from nimble.dtypes import STORABLE, refusal
from nimble.errors import ArtifactError, UnsupportedError

from .spec import MAX_SAFETENSORS_HEADER

# safetensors dtype codes -> (nimble dtype name, bytes per element), from nimble's one dtype table
DTYPES = {d.safetensors: (d.name, d.itemsize) for d in STORABLE}
DTYPES_TORCH = {d.name: getattr(torch, d.name) for d in STORABLE}
_CODES = {DTYPES_TORCH[name]: code for code, (name, _) in DTYPES.items()}


def read_header(data: bytes, member: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) of a safetensors blob, after checking its layout."""
    if len(data) < 8:
        raise ArtifactError(f"{member} is truncated (no header)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_SAFETENSORS_HEADER or 8 + n > len(data):
        raise ArtifactError(f"{member} declares a {n}-byte header in a {len(data)}-byte member")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ArtifactError(f"{member} has a header that is not JSON") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{member} has a malformed header")
    header.pop("__metadata__", None)
    out, ranges = {}, []
    for name, info in header.items():
        if not isinstance(info, dict) or info.get("dtype") not in DTYPES:
            raise ArtifactError(f"{member}: tensor '{name}' has an unknown dtype")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise ArtifactError(f"{member}: tensor '{name}' has a malformed shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ArtifactError(f"{member}: tensor '{name}' has malformed data offsets")
        dtype, itemsize = DTYPES[info["dtype"]]
        if offsets[1] - offsets[0] != math.prod(shape) * itemsize or offsets[0] < 0:
            raise ArtifactError(f"{member}: tensor '{name}' spans {offsets[1] - offsets[0]} bytes, "
                                f"its shape needs {math.prod(shape) * itemsize}")
        ranges.append((offsets[0], offsets[1], name))
        out[name] = (dtype, tuple(shape))
    cursor = 0
    for start, end, name in sorted(ranges):
        if start != cursor:
            raise ArtifactError(f"{member}: tensor '{name}' overlaps another or leaves a gap")
        cursor = end
    if 8 + n + cursor != len(data):
        raise ArtifactError(f"{member}: data is {len(data) - 8 - n} bytes, the header describes {cursor}")
    return out


def load(data: bytes | bytearray | memoryview, member: str, expected: dict[str, tuple[str, tuple[int, ...]]]):
    """The tensors of a safetensors blob whose header must describe exactly `expected`. The
    tensors are views of `data`'s bytes (pass a bytearray or a writable memoryview to keep them
    writable)."""
    found = read_header(data, member)
    if found != expected:
        missing = sorted(set(expected) - set(found)) or sorted(k for k in found if found[k] != expected.get(k))
        raise ArtifactError(f"{member} does not match the graph (first difference: '{(missing or ['?'])[0]}')")
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(bytes(data[8:8 + n]))
    out = {}
    for name, (dtype, shape) in found.items():
        start, end = header[name]["data_offsets"]
        flat = torch.frombuffer(data, dtype=torch.uint8, count=end - start, offset=8 + n + start) if end > start \
            else torch.empty(0, dtype=torch.uint8)
        out[name] = flat.view(DTYPES_TORCH[dtype]).reshape(shape)
    return out


def serialize(tensors: dict[str, torch.Tensor]) -> list[bytes | memoryview]:
    """A safetensors blob as chunks (header, then each tensor's bytes, by name), without
    copying tensor data. Any safetensors reader can load the joined chunks."""
    names = sorted(tensors)
    flats = {k: tensors[k].detach().contiguous().reshape(-1).view(torch.uint8) for k in names}
    header, offset = {}, 0
    for k in names:
        code = _CODES.get(tensors[k].dtype)
        if code is None:
            raise UnsupportedError(f"tensor '{k}': {refusal(str(tensors[k].dtype).removeprefix('torch.'))}")
        header[k] = {"dtype": code, "shape": list(tensors[k].shape), "data_offsets": [offset, offset + flats[k].numel()]}
        offset += flats[k].numel()
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)) + text] + [memoryview(flats[k].numpy()) for k in names if flats[k].numel()]


def save(tensors: dict[str, torch.Tensor]) -> bytes:
    return b"".join(serialize(tensors))
