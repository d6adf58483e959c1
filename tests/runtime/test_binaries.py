"""Records of compiled kernels (`runtime/kernels/binaries.py`): what one says about Triton's compiled
kernel, which kernels get none, and what a record must be before a launch trusts it (crafted
records in the cache folder are misses, never launches). The launches themselves are
`test_gpu_binaries.py`."""

import json
import os

import pytest
import torch

from nimble.runtime.kernels import binaries


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


@pytest.fixture
def triton_cache(tmp_path, monkeypatch):
    """A stand-in for `triton.runtime.cache` whose cache manager keeps every kernel in tmp_path."""
    import sys
    import types

    folder = tmp_path / "triton"
    folder.mkdir()
    module = types.ModuleType("triton.runtime.cache")
    module.get_cache_manager = lambda key: types.SimpleNamespace(cache_dir=str(folder))
    for name in ("triton", "triton.runtime"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "triton.runtime.cache", module)
    return folder


def compiled(folder, binary=b"\x7fELF-cubin", written=None, signature=None, constants=None, **meta):
    """A CompiledKernel as Triton 3.6 describes one: kernel(out_ptr, x_ptr, s, N, BLOCK: constexpr)."""
    import types

    (folder / "kernel.cubin").write_bytes(binary if written is None else written)
    fields = {"name": "kernel", "num_warps": 4, "num_ctas": 1, "shared": 0, "global_scratch_size": 0,
              "profile_scratch_size": 0, **meta}
    src = types.SimpleNamespace(
        signature=signature or {"out_ptr": "*fp32", "x_ptr": "*fp32", "s": "fp32", "N": "i32", "BLOCK": "constexpr"},
        constants=constants if constants is not None else {(4,): 1024})
    return types.SimpleNamespace(metadata=types.SimpleNamespace(**fields), asm={"cubin": binary}, src=src, hash="h")


NAMES = ["out_ptr", "x_ptr", "s", "N", "BLOCK"]


def test_the_record_of_a_compiled_kernel_names_what_the_binary_takes(triton_cache):
    args, constants = (torch.empty(4), torch.empty(4), 0.5), {"N": 4, "BLOCK": 1024}
    record = binaries._describe_compiled(compiled(triton_cache), args, constants, NAMES)
    assert record["params"] == [[0, "O"], [1, "O"], [2, "f"], ["N", "i"]]  # BLOCK is a constexpr: not passed
    assert record["scratch"] == 2 and record["num_warps"] == 4 and record["shared"] == 0
    assert record["binary"] == str((triton_cache / "kernel.cubin").resolve()) and record["size"] == 10
    path = triton_cache / "record.json"
    path.write_text(json.dumps(record))
    assert binaries.read_record(path, args, constants) == record  # what nimble writes, it reads back
    # N == 1: Triton makes it a constant of the binary, which then takes no N
    one = compiled(triton_cache, signature={"out_ptr": "*fp32", "x_ptr": "*fp32", "s": "fp32", "N": "constexpr",
                                            "BLOCK": "constexpr"}, constants={(3,): 1, (4,): 1024})
    assert binaries._describe_compiled(one, args, {"N": 1, "BLOCK": 1024}, NAMES)["params"] == \
        [[0, "O"], [1, "O"], [2, "f"]]
    older = compiled(triton_cache)  # an older Triton: no scratch fields, and the binary takes no scratch pointers
    del older.metadata.global_scratch_size, older.metadata.profile_scratch_size
    assert binaries._describe_compiled(older, args, constants, NAMES)["scratch"] == 0


@pytest.mark.parametrize("case", ["scratch", "ctas", "elsewhere", "default"])
def test_what_the_static_launcher_cannot_run_is_not_recorded(triton_cache, case):
    args, constants = (torch.empty(4), torch.empty(4), 0.5), {"N": 4, "BLOCK": 1024}
    kernel = {"scratch": lambda: compiled(triton_cache, global_scratch_size=256),
              "ctas": lambda: compiled(triton_cache, num_ctas=2),
              "elsewhere": lambda: compiled(triton_cache, written=b"another binary"),  # not Triton's file
              "default": lambda: compiled(triton_cache)}[case]()
    if case == "default":  # N left at a default the call does not pass
        assert binaries._describe_compiled(kernel, args[:3], {"BLOCK": 1024}, NAMES) is None
    else:
        assert binaries._describe_compiled(kernel, args, constants, NAMES) is None


def test_a_generated_kernel_asks_for_a_binary_once_per_signature_and_records_what_triton_built(monkeypatch):
    """`generated.Generated`: a recalled binary runs without Triton; a miss goes to Triton once
    per signature, which builds it without launching it; the build is recorded and launched from
    its record, or by Triton where it cannot be recorded."""
    from nimble.runtime.kernels import generated

    asked, recorded, ran = [], [], []

    class Recorded:
        def run(self, grid, args, constants):
            ran.append(("binary", grid, args[2]))

    def recall(digest, signature, args, constants):
        asked.append(signature)
        return Recorded() if args[2] == 0.25 else None  # only this value's binary was recorded

    def remember(digest, signature, compiled, args, constants, arg_names):
        recorded.append((signature, compiled, arg_names))
        return Recorded() if args[2] == 0.5 else None  # 0.75's build cannot be recorded

    class Jit:
        arg_names = ["out_ptr", "x_ptr", "s", "N", "BLOCK"]

        def warmup(self, *args, grid, **constants):
            ran.append(("built", grid, args[2]))
            return "compiled"

        def __getitem__(self, grid):
            def launch(*args, **constants):
                ran.append(("triton", grid, args[2]))
                return "compiled"
            return launch

    monkeypatch.setattr(binaries, "recall", recall)
    monkeypatch.setattr(binaries, "remember", remember)
    kernel = generated.Generated("source", "d" * 32)
    monkeypatch.setattr(kernel, "jit", lambda: Jit())
    x = torch.empty(8)
    for s in (0.25, 0.25, 0.5, 0.5, 0.75, 0.75):
        kernel[(2,)](x, x, s, N=8, BLOCK=1024)
    assert ran == [("binary", (2,), 0.25), ("binary", (2,), 0.25), ("built", (2,), 0.5), ("binary", (2,), 0.5),
                   ("binary", (2,), 0.5), ("built", (2,), 0.75), ("triton", (2,), 0.75), ("triton", (2,), 0.75)]
    assert len(asked) == 3 and len(set(asked)) == 3  # each signature asked for once
    assert recorded == [(asked[1], "compiled", Jit.arg_names), (asked[2], "compiled", Jit.arg_names)]
