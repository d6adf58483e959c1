"""What `read_artifact` checks of an artifact's members before it builds anything from them:
the JSON members' sizes and strictness (no duplicate keys, NaN or Infinity), the manifest's every
field, and that every op is an allowlisted overload. Each refusal is one ArtifactError line."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import struct
import zipfile

import torch

from nimble import __version__
from nimble.errors import ArtifactError, GraphError
from nimble.ir import Graph
from nimble.ops import fusion

from .spec import FORMAT_VERSION, MANIFEST, MAX_BATCH_SIZES, MAX_MANIFEST_BYTES, MAX_STRING, MEMBERS, batch_members, limit


def load_json(z: zipfile.ZipFile, member: str, name: str):
    check_json_size(z, member, name)
    return parse_json(z.read(member), member, name)


# a zip member's local header: signature, version, flags, method, time, date, CRC, sizes, name and extra lengths
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
_CHUNK = 16 * 2**20


def read_member(raw, info: zipfile.ZipInfo, file_size: int, sha256: str, name: str) -> memoryview:
    """A stored member's bytes, read straight from the file into one writable buffer that is
    never zeroed first (tensors view it), each chunk hashed while the next is read, and checked
    against its sha256. `ZipFile.read` copied them and checked a CRC too, and the bytearray they
    went into was zeroed first: BERT-base's read took 1.26 s on the CPU builder, 0.46 s now. `raw` is the artifact
    opened for reading; `info` is the member's entry in the zip's directory, `file_size` the
    artifact's size. The member's local header must name it and store it uncompressed, and its
    bytes must lie inside the file."""
    raw.seek(info.header_offset)
    header = raw.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise ArtifactError(f"{name}: {info.filename} has no local header where the zip's directory points")
    fields = _LOCAL_HEADER.unpack(header)
    method, name_length, extra_length = fields[3], fields[-2], fields[-1]
    if method != zipfile.ZIP_STORED or raw.read(name_length) != info.filename.encode():
        raise ArtifactError(f"{name}: {info.filename}'s local header disagrees with the zip's directory")
    start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    if start + info.file_size > file_size:
        raise ArtifactError(f"{name}: {info.filename} runs past the end of the file")
    raw.seek(start)
    view, digest = memoryview(torch.empty(info.file_size, dtype=torch.uint8).numpy()), hashlib.sha256()
    with concurrent.futures.ThreadPoolExecutor(1) as hashing:  # a chunk is hashed while the next is read
        hashed = None
        for at in range(0, info.file_size, _CHUNK):
            part = view[at:at + _CHUNK]
            if raw.readinto(part) != len(part):
                raise ArtifactError(f"{name}: {info.filename} is cut short")
            if hashed is not None:
                hashed.result()
            hashed = hashing.submit(digest.update, part)
        if hashed is not None:
            hashed.result()
    if digest.hexdigest() != sha256:
        raise ArtifactError(f"{name}: {info.filename} does not match its sha256 in the manifest")
    return view


def check_json_size(z: zipfile.ZipFile, member: str, name: str) -> None:
    cap = MAX_MANIFEST_BYTES if member == MANIFEST else limit("MAX_JSON_BYTES")
    if z.getinfo(member).file_size > cap:
        raise ArtifactError(f"{name}: {member} is larger than {cap} bytes"
                            + ("" if member == MANIFEST else " (raise the cap with NIMBLE_MAX_JSON_BYTES)"))


def parse_json(data: bytes, member: str, name: str):
    """Strict JSON: duplicate keys, NaN and Infinity are refused, not silently resolved."""
    def unique(pairs):
        obj = dict(pairs)
        if len(obj) != len(pairs):
            keys = [k for k, _ in pairs]
            raise _Refused(f"a duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
        return obj

    def constant(text):
        raise _Refused(f"a bare {text}")

    try:
        doc = json.loads(bytes(data) if isinstance(data, memoryview) else data, object_pairs_hook=unique,
                         parse_constant=constant)
    except _Refused as e:
        raise ArtifactError(f"{name}: {member} holds {str(e)[:80]}") from None
    except (UnicodeDecodeError, ValueError, RecursionError):  # JSONDecodeError is a ValueError
        raise ArtifactError(f"{name}: {member} is not valid JSON") from None
    if not isinstance(doc, dict):
        raise ArtifactError(f"{name}: {member} is not a JSON object")
    return doc


class _Refused(Exception):
    pass


def check_manifest(m: dict, name: str) -> None:
    version = m.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ArtifactError(f"{name}: manifest has no valid format_version")
    if version > FORMAT_VERSION:
        writer = m.get("nimble_version") if isinstance(m.get("nimble_version"), str) else "?"
        raise ArtifactError(f"{name} has format version {version}, newer than the {FORMAT_VERSION} this nimble "
                            f"({__version__}) reads; it was written by nimble {writer[:40]}: upgrade nimble to that "
                            "build or later, or compile the model again with this one")
    for key, kind in (("nimble_version", str), ("torch_version", str), ("model", str), ("source_sha256", str),
                      ("options", dict), ("inputs", list), ("outputs", list), ("members", dict)):
        if not isinstance(m.get(key), kind):
            raise ArtifactError(f"{name}: manifest field '{key}' is missing or malformed")
    if _longest_string(m) > MAX_STRING:
        raise ArtifactError(f"{name}: the manifest holds a string longer than {MAX_STRING} characters")
    passes = m.get("passes", [])  # optional: artifacts before nimble recorded the passes have none
    if not (isinstance(passes, list) and len(passes) <= 1000 and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and type(p[1]) is int and p[1] >= 0
            for p in passes)):
        raise ArtifactError(f"{name}: manifest field 'passes' is malformed")
    if "precision" in m:
        _check_precision(m["precision"], name)
    sizes = m.get("batch_sizes", [])
    if not (isinstance(sizes, list) and len(sizes) <= MAX_BATCH_SIZES and all(type(b) is int and 1 <= b <= 2**16
                                                                              for b in sizes)
            and sizes == sorted(set(sizes)) and len(sizes) != 1):
        raise ArtifactError(f"{name}: manifest field 'batch_sizes' is malformed")
    for member in [*MEMBERS[1:], *batch_members(sizes)]:
        entry = m["members"].get(member)
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and isinstance(entry.get("size"), int) and entry["size"] >= 0):
            raise ArtifactError(f"{name}: manifest lists no valid sha256 and size for {member}")


def _check_precision(p, name: str) -> None:
    """A reduced-precision record (`pipeline._choose_precision`), field by field."""
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    def count(x) -> bool:
        return type(x) is int and 0 <= x <= 10**7

    op_keys = {"op", "target", "source", "why"}
    fine = (isinstance(p, dict) and set(p) == {"dtype", "io", "tolerance", "searched", "fp32_ops", "floating_ops",
                                                "errors", "tries"}
            and p["dtype"] in ("float16", "bfloat16") and p["io"] in ("model", "reduced")
            and number(p["tolerance"]) and 0 < p["tolerance"] < 1 and isinstance(p["searched"], bool)
            and count(p["floating_ops"]) and count(p["tries"])
            and isinstance(p["errors"], list) and len(p["errors"]) <= 10**4 and all(number(e) for e in p["errors"])
            and isinstance(p["fp32_ops"], list) and len(p["fp32_ops"]) <= 10**6
            and all(isinstance(o, dict) and set(o) == op_keys and all(isinstance(o[k], str) for k in op_keys)
                    and o["why"] in ("policy", "kept") for o in p["fp32_ops"]))
    if not fine:
        raise ArtifactError(f"{name}: manifest field 'precision' is malformed")


def _longest_string(doc) -> int:
    if isinstance(doc, str):
        return len(doc)
    if isinstance(doc, dict):
        return max((max(len(k), _longest_string(v)) for k, v in doc.items()), default=0)
    if isinstance(doc, list):
        return max((_longest_string(v) for v in doc), default=0)
    return 0


def check_ops(graph: Graph, name: str) -> None:
    from nimble.ops.targets import device_ops

    table = device_ops()
    for op in graph.ops:
        if op.target == fusion.FUSED:
            try:
                fusion.check(op)
            except GraphError as e:
                raise ArtifactError(f"{name}: {e}") from None
            missing = next((node[0] for node in fusion.body_of(op) if node[0] not in table), None)
            if missing is not None:
                raise ArtifactError(f"{name}: fused op {op.id} holds {missing!r}, which is not an allowlisted "
                                    f"overload in torch {torch.__version__}; recompile the model with this nimble "
                                    "and torch")
            continue
        if op.target not in table:
            raise ArtifactError(f"{name}: op {op.id} has target {op.target!r}, which is not an allowlisted overload "
                                f"in torch {torch.__version__} (out= overloads never are); recompile the model "
                                "with this nimble and torch")
