"""Kernel packs: generated kernels built ahead of time (`nimble compile --gpu-arch`), kept apart
from the artifact, used only where the user trusts them.

An artifact is data: loading one runs no code of its author's. A kernel pack holds machine code,
so it is never used because it came with an artifact. A load uses a pack only

- where the user names it (`nimble run --kernels PACK`, `nimble.load(..., kernels=PACK)`): naming
  it says "I trust this file as I trust a program I run"; or
- where the user configured a key (`NIMBLE_KERNEL_KEY`, the path of a file of at least 16 bytes)
  and the pack carries a signature made with that key (`nimble compile --sign-with KEY`): then the
  pack beside the artifact (`model.nimble.kernels`) is found without naming it, and a named pack
  must carry that signature too. The signature is an HMAC-SHA256 over the manifest, which holds
  the sha256 of every binary: a changed binary, or a manifest rewritten without the key, fails.

Each binary is bound to the digest of the generated source it was built from and the call
signature it was built for (what `binaries.py` keys a recorded binary by), and the pack as a whole
to the architecture, Triton's version and nimble's kernel code (`binding`). A pack whose binding is
not this load's, or that does not check, is a miss in one line (`PackMiss`): the kernels are built
from source. A binary is taken only for the exact source and signature of the launch at hand,
after its sha256 is checked and its launch record checked against the call
(`binaries.fits`), and it is kept in the cache folder (`binaries.install`), nowhere else.

Layout: `MAGIC`, the manifest's length (8 bytes, little-endian), the manifest (JSON), then the
binaries, each deflated (zlib) at the offset the manifest gives. Every length is checked against
the file before anything is read or allocated, and a binary inflates to at most the size its
record gives.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ... import __version__
from ..base import cache
from . import binaries
from .recall import runtime_code

MAGIC = b"NIMBLE-KERNELS 1\n"
SUFFIX = ".kernels"  # the pack beside `model.nimble` is `model.nimble.kernels`
KEY_ENV = "NIMBLE_KERNEL_KEY"
MANIFEST_LIMIT = 32 * 2**20
PACK_LIMIT = 2 * 2**30
MAX_ENTRIES = 200_000
MIN_KEY = 16


class PackMiss(Exception):
    """A pack this load does not use: the message is the one line that says why."""


def binding(arch: int) -> dict:
    """What every binary of a pack for `arch` is bound to, besides its source and signature."""
    return {"arch": f"sm_{arch}", "triton": binaries.triton_version(), "nimble": __version__,
            "kernel_code": runtime_code()}


def configured_key() -> bytes | None:
    """The key `NIMBLE_KERNEL_KEY` names, or None where it is unset; a key that cannot be read is
    an error in one line (a configured key that silently did nothing would be worse)."""
    where = os.environ.get(KEY_ENV)
    if not where:
        return None
    return read_key(where)


def read_key(where: str) -> bytes:
    data = cache.read_small(Path(where), 4096)
    if data is None or len(data.strip()) < MIN_KEY:
        raise PackMiss(f"the kernel key {where} is not a readable file of {MIN_KEY} to 4096 bytes; "
                       f"make one with: head -c 32 /dev/urandom > {where}")
    return data.strip()


def _mac(key: bytes, manifest: dict) -> str:
    body = json.dumps({k: v for k, v in manifest.items() if k != "mac"}, sort_keys=True).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


@dataclass
class Entry:
    source: str  # the digest of the generated source (`generated.define`)
    signature: str  # the call signature (`binaries.specialisation`)
    record: dict  # the launch record (`binaries.describe`): name, warps, shared memory, parameters
    binary: bytes


def write(path: Path, arch: int, entries: list[Entry], key: bytes | None = None, walked: dict | None = None) -> int:
    """Write a pack of `entries`, built for `arch`, signed with `key` where given; its bytes.
    `walked`: what the walk that found the entries walked, `{"plan": the artifact's
    `plan_digest`, "multiprocessors": the target's}` (see `Pack.covers`)."""
    manifest = {**binding(arch), "torch": torch.__version__, **(walked or {}), "entries": []}
    offset, blobs = 0, []
    for e in entries:
        blob = zlib.compress(e.binary, 6)  # machine code packs 3 to 4 times smaller
        manifest["entries"].append({"source": e.source, "signature": e.signature, "record": e.record,
                                    "offset": offset, "size": len(blob)})
        blobs.append(blob)
        offset += len(blob)
    if key is not None:
        manifest["mac"] = _mac(key, manifest)
    head = json.dumps(manifest, sort_keys=True).encode()
    data = MAGIC + len(head).to_bytes(8, "little") + head + b"".join(blobs)
    from ...fileio import write_atomic

    write_atomic(path, data)
    return len(data)


@dataclass
class Pack:
    """A pack opened for a load: its manifest checked, its binaries read on demand."""

    path: Path
    manifest: dict
    start: int  # where the binaries begin
    index: dict = field(default_factory=dict)  # (source, signature) -> entry
    taken: int = 0
    refused: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, path: str | Path, arch: int, key: bytes | None, named: bool) -> Pack:
        """The pack at `path` for a load on `arch`; raises PackMiss where it is not used: not a
        pack, malformed, bound to another architecture, Triton or nimble, or (with a configured
        `key`) unsigned or not signed with it. `named`: the user named it (else it was found
        beside the artifact, and is used only where signed with the configured key)."""
        path = Path(path)
        if key is None and not named:
            raise PackMiss(f"{path}: not used: a pack found beside the artifact is used only where {KEY_ENV} names "
                           "the key it is signed with; name it with --kernels to trust it")
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + 8)
                if head[:len(MAGIC)] != MAGIC or len(head) != len(MAGIC) + 8:
                    raise PackMiss(f"{path}: not a nimble kernel pack")
                length = int.from_bytes(head[len(MAGIC):], "little")
                if not 0 < length <= min(MANIFEST_LIMIT, size - len(head)) or size > PACK_LIMIT:
                    raise PackMiss(f"{path}: a kernel pack whose manifest does not fit the file")
                manifest = json.loads(f.read(length))
        except OSError as e:
            raise PackMiss(f"{path}: cannot be read ({e.strerror or e})") from None
        except (ValueError, RecursionError):
            raise PackMiss(f"{path}: a kernel pack whose manifest is not JSON") from None
        start = len(MAGIC) + 8 + length
        if not isinstance(manifest, dict) or not isinstance(manifest.get("entries"), list) \
                or len(manifest["entries"]) > MAX_ENTRIES:
            raise PackMiss(f"{path}: a kernel pack whose manifest is malformed")
        if key is not None:
            mac = manifest.get("mac")
            if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(key, manifest)):
                raise PackMiss(f"{path}: not signed with the key {KEY_ENV} names: not used")
        want = binding(arch)
        for name, value in want.items():
            if manifest.get(name) != value:
                raise PackMiss(f"{path}: built for {name} {manifest.get(name)!r}, this load needs {value!r}: not used, "
                               "kernels build from source")
        pack = cls(path, manifest, start)
        if manifest.get("torch") != torch.__version__:  # nimble generates some kernels' text from what torch says
            pack.notes.append(f"{path}: built with torch {manifest.get('torch')}, this load runs {torch.__version__}; "
                              "kernels whose generated source differs build here (build the pack with this torch)")
        for e in manifest["entries"]:
            if not (isinstance(e, dict) and isinstance(e.get("source"), str) and isinstance(e.get("signature"), str)
                    and type(e.get("offset")) is int and type(e.get("size")) is int
                    and 0 <= e["offset"] and 0 < e["size"] <= binaries.BINARY_LIMIT
                    and start + e["offset"] + e["size"] <= size and isinstance(e.get("record"), dict)):
                raise PackMiss(f"{path}: a kernel pack with a malformed entry: not used")
            pack.index[e["source"], e["signature"]] = e
        return pack

    def __len__(self) -> int:
        return len(self.index)

    def covers(self, plan: str, multiprocessors: int) -> bool:
        """Whether this pack holds every kernel a walk of this load would find: it was walked from
        this plan (`formats.plan_digest`), for a GPU of these multiprocessors, with this torch
        (nimble generates some kernels' text from what torch says). Then a load need not walk: it
        takes each kernel from the pack as it first launches (`binaries.trust`). A manifest that
        says so wrongly costs builds at first launch, nothing more: each binary is still taken only
        for its exact source and call."""
        m = self.manifest
        return m.get("plan") == plan and m.get("multiprocessors") == multiprocessors and m.get("torch") == torch.__version__

    def take(self, source: str, signature: str, args: tuple, constants: dict,
             device: torch.device) -> binaries.Binary | None:
        """The binary for this source and call, checked and loaded (kept in the cache folder);
        None where the pack has none, or one that does not check (then noted in `refused`)."""
        e = self.index.get((source, signature))
        if e is None:
            return None
        record = e["record"]
        if not binaries.fits(record, args, constants):
            self.refused.append(f"kernel k{source}: its launch record does not fit the call")
            return None
        inflate = zlib.decompressobj()
        try:
            with open(self.path, "rb") as f:
                f.seek(self.start + e["offset"])
                stored = f.read(e["size"])
            data = inflate.decompress(stored, record["size"] + 1)  # never more than the record says, plus one
        except (OSError, zlib.error):
            data = b""
        if len(data) != record["size"] or not inflate.eof or inflate.unconsumed_tail \
                or hashlib.sha256(data).hexdigest() != record["sha256"]:
            self.refused.append(f"kernel k{source}: its binary does not match its recorded sha256 (changed after "
                                "the pack was built)")
            return None
        binary = binaries.install(source, signature, record, data, device)
        if binary is not None:
            self.taken += 1
        return binary
