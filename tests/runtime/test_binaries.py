"""What a record of a compiled kernel (`runtime/binaries.py`) must be before a launch trusts it:
crafted records in the cache folder are misses, never launches. The launches themselves are
`test_gpu_binaries.py`."""

import json
import os

import pytest
import torch

from nimble.runtime import binaries


def valid(tmp_path):
    binary = tmp_path / "kernel.cubin"
    binary.write_bytes(b"\x7fELF" + bytes(60))
    return {"version": 1, "binary": str(binary), "size": 64, "sha256": "a" * 64, "name": "kernel",
            "num_warps": 4, "shared": 0, "scratch": 2, "params": [[0, "O"], [1, "O"], [2, "f"], ["N", "i"]]}


def call():
    return (torch.empty(8), torch.empty(8), 0.5), {"N": 8, "BLOCK": 1024}


def read(tmp_path, record) -> dict | None:
    path = tmp_path / "record.json"
    path.write_text(record if isinstance(record, str) else json.dumps(record))
    args, constants = call()
    return binaries.read_record(path, args, constants)


def test_a_record_as_nimble_writes_it_is_read(tmp_path):
    assert read(tmp_path, valid(tmp_path)) == valid(tmp_path)


@pytest.mark.parametrize("change", [
    {"version": 2}, {"size": 0}, {"size": binaries.BINARY_LIMIT + 1}, {"size": "64"}, {"size": True},
    {"num_warps": 3}, {"shared": -1}, {"shared": binaries.MAX_SHARED + 1}, {"scratch": 3},
    {"sha256": "A" * 64}, {"sha256": "a" * 63}, {"name": "kernel; rm -rf"}, {"name": ""},
    {"binary": "relative/kernel.cubin"}, {"binary": "/tmp/a\0b"}, {"binary": 7},
    {"params": [[3, "O"]]},  # no fourth positional argument
    {"params": [["M", "i"]]},  # no constant M
    {"params": [[0, "i"]]},  # a tensor passed as an integer
    {"params": [[2, "O"]]},  # a float passed as a pointer
    {"params": [["N", "f"]]},  # an integer passed as a float
    {"params": [[0, "Z"]]},  # a type the launcher does not know
    {"params": [[0]]}, {"params": {"0": "O"}}, {"params": [[0, "O"]] * 65},
])
def test_a_crafted_field_makes_the_record_a_miss(tmp_path, change):
    assert read(tmp_path, {**valid(tmp_path), **change}) is None


@pytest.mark.parametrize("text", ["", "[]", "{", "null", "[" * 100_000, json.dumps({"version": 1})])
def test_what_is_not_a_record_is_a_miss(tmp_path, text):
    assert read(tmp_path, text) is None


def test_an_oversized_or_linked_record_is_not_read(tmp_path):
    big = json.dumps({**valid(tmp_path), "pad": "x" * binaries.RECORD_LIMIT})
    assert read(tmp_path, big) is None
    target = tmp_path / "target.json"
    target.write_text(json.dumps(valid(tmp_path)))
    link = tmp_path / "link.json"
    os.symlink(target, link)
    args, constants = call()
    assert binaries.read_record(link, args, constants) is None


def test_the_signature_names_what_a_binary_depends_on():
    x = torch.empty(16)
    args = (x, x, 0.5)
    base = binaries.specialisation(args, {"N": 16, "BLOCK": 1024})
    assert base == binaries.specialisation((torch.empty(16), torch.empty(16), 0.5), {"N": 16, "BLOCK": 1024}) \
        or x.data_ptr() % 16 != 0
    different = [
        ((x[1:], x, 0.5), {"N": 16, "BLOCK": 1024}),  # 4 bytes off: not 16-byte aligned
        ((x.double(), x, 0.5), {"N": 16, "BLOCK": 1024}),  # dtype
        ((x, x, 0.25), {"N": 16, "BLOCK": 1024}),  # a scalar's value
        ((x, x, 0.5), {"N": 1, "BLOCK": 1024}),  # an integer Triton would make a constant
        ((x, x, 0.5), {"N": 16, "BLOCK": 512}),  # a constexpr
        ((x, x, 0.5), {"N": 16, "BLOCK": 1024, "num_warps": 8}),  # a launch option
        ((x, x), {"N": 16, "BLOCK": 1024, "s": 0.5}),  # the same value passed by name
        ((x, x, True), {"N": 16, "BLOCK": 1024}),  # a bool is not a float
    ]
    for args, constants in different:
        assert binaries.specialisation(args, constants) != base, (args, constants)


def test_without_cuda_nothing_is_recalled_or_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    args, constants = call()
    signature = binaries.specialisation(args, constants)
    assert binaries.recall("d" * 32, signature, args, constants) is None
    assert binaries.remember("d" * 32, signature, object(), args, constants, ["a", "b", "s", "N", "BLOCK"]) is None
    assert not (tmp_path / "cache" / "binaries").exists() or not any((tmp_path / "cache" / "binaries").iterdir())
