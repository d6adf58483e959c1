"""Kernel packs (`runtime/kernels/pack.py`), built on this machine, which has no GPU: a prebuild's
walk finds the launches, Triton builds them for sm_90, and a pack is used only where trusted and
only where every binding checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nimble.formats import plan_digest, read_artifact, write_artifact
from nimble.pipeline import compile_model
from nimble.runtime import prebuild
from nimble.runtime.kernels import aot, binaries
from nimble.runtime.kernels import pack as packs
from nimble.specs import input_specs

from ..cli.test_cli import invoke, one_line_error
from ..conftest import SAMPLES

pytest.importorskip("triton", reason="CI installs Triton with the test extras (pyproject.toml)")
H100 = aot.Target(90, 132)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The sample resnet's artifact and its pack for sm_90, built here with no GPU, in caches of
    its own (Triton's included)."""
    folder = tmp_path_factory.mktemp("pack")
    old = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "NIMBLE_CACHE_DIR")}
    os.environ["TRITON_CACHE_DIR"], os.environ["NIMBLE_CACHE_DIR"] = str(folder / "triton"), str(folder / "cache")
    try:
        compiled = compile_model(SAMPLES / "resnet.pt", input_specs(["1x3x32x32"]), device="cpu")
        art = compiled.artifact()
        path = folder / "resnet.nimble"
        write_artifact(path, art)
        (made,) = prebuild.ahead(art, [H100], Path(f"{path}{packs.SUFFIX}"), threads=2)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return art, path, made


def _launches(art):
    return prebuild.walk(art, H100)


def test_a_pack_is_built_for_a_named_architecture_with_no_gpu(built):
    art, path, (target, pack_path, kernels, failed) = built
    assert not torch.cuda.is_available() and target.name == "sm_90"
    assert kernels > 0 and not failed
    pack = packs.Pack.open(pack_path, 90, None, named=True)
    assert len(pack) == kernels == len(_launches(art))
    for (source, signature), e in pack.index.items():
        assert "@cuda:" in signature and e["record"]["name"] and e["record"]["sha256"]
    # the pack is small beside the artifact's weights
    assert pack_path.stat().st_size < path.stat().st_size


def test_the_walk_notes_launches_and_leaves_no_choice_behind(built):
    art = built[0]
    found = _launches(art)
    assert found and all(isinstance(k[0], str) and len(k[0]) == 32 for k in found)
    assert _launches(art).keys() == found.keys()  # the same walk twice finds the same launches


@pytest.mark.parametrize("change, why", [
    ("arch", "built for arch 'sm_90', this load needs 'sm_80'"),
    ("triton", "built for triton"),
    ("nimble", "built for kernel_code"),
])
def test_a_pack_for_another_architecture_or_version_is_a_miss(built, monkeypatch, change, why):
    pack_path = built[2][1]
    arch = 80 if change == "arch" else 90
    if change == "triton":
        monkeypatch.setattr(binaries, "triton_version", lambda: "0.0.1")
    if change == "nimble":
        monkeypatch.setattr(packs, "runtime_code", lambda: "another")
    with pytest.raises(packs.PackMiss, match=why.replace("(", r"\(")):
        packs.Pack.open(pack_path, arch, None, named=True)


def _copy(pack_path: Path, tmp_path: Path, edit=None) -> Path:
    data = bytearray(pack_path.read_bytes())
    if edit:
        data = edit(data)
    out = tmp_path / "copy.kernels"
    out.write_bytes(bytes(data))
    return out


def _first(pack):
    (source, signature), entry = next(iter(pack.index.items()))
    return source, signature, entry


class _Loaded:
    """Stands for a loaded binary: this machine has no GPU to load one on."""

    def __init__(self, record, device):
        self.record = record


def test_a_checked_binary_is_kept_in_the_cache_folder_and_nowhere_else(built, tmp_path, monkeypatch):
    art, _, (_, pack_path, _, _) = built
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(binaries, "Binary", _Loaded)
    monkeypatch.setattr(binaries, "_record_path", lambda d, s, dev: tmp_path / "cache" / "binaries" / f"r{d}.json")
    before = {p for p in tmp_path.rglob("*")}
    pack = packs.Pack.open(pack_path, 90, None, named=True)
    launches = _launches(art)
    source, signature, entry = _first(pack)
    kernel, args, constants = launches[source, signature]
    got = pack.take(source, signature, args, constants, torch.device("cuda", 0))
    assert isinstance(got, _Loaded) and pack.taken == 1 and not pack.refused
    written = {p for p in tmp_path.rglob("*") if p.is_file()} - before
    assert written and all((tmp_path / "cache") in p.parents for p in written)
    cubin = [p for p in written if p.suffix == ".cubin"]
    assert len(cubin) == 1 and cubin[0].read_bytes()[:4] == b"\x7fELF"  # the binary, as built


def test_a_tampered_binary_is_refused_before_it_is_loaded(built, tmp_path, monkeypatch):
    art, _, (_, pack_path, _, _) = built
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    loaded = []
    monkeypatch.setattr(binaries, "Binary", lambda record, device: loaded.append(record))
    pack = packs.Pack.open(pack_path, 90, None, named=True)
    source, signature, entry = _first(pack)

    def flip(data):
        data[pack.start + entry["offset"] + entry["size"] // 2] ^= 0xFF
        return data
    tampered = packs.Pack.open(_copy(pack_path, tmp_path, flip), 90, None, named=True)
    kernel, args, constants = _launches(art)[source, signature]
    assert tampered.take(source, signature, args, constants, torch.device("cuda", 0)) is None
    assert not loaded and "does not match its recorded sha256" in tampered.refused[0]
    assert not (tmp_path / "cache" / "binaries").exists() or not list((tmp_path / "cache" / "binaries").glob("*.cubin"))


def test_a_binary_is_taken_only_for_its_own_source_and_call(built, tmp_path, monkeypatch):
    art, _, (_, pack_path, _, _) = built
    monkeypatch.setattr(binaries, "Binary", _Loaded)
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    pack = packs.Pack.open(pack_path, 90, None, named=True)
    launches = _launches(art)
    source, signature, entry = _first(pack)
    kernel, args, constants = launches[source, signature]
    other = next(s for s, _ in launches if s != source)
    assert pack.take(other, signature, args, constants, torch.device("cuda", 0)) is None  # another source
    assert pack.take(source, signature + ";x=int:1", args, constants, torch.device("cuda", 0)) is None
    # an entry whose launch record names an argument the call lacks is refused, not launched
    entry["record"] = {**entry["record"], "params": [[len(args) + 5, "O"]]}
    assert pack.take(source, signature, args, constants, torch.device("cuda", 0)) is None
    assert "launch record does not fit" in pack.refused[0]


def test_a_pack_covers_the_plan_it_was_walked_from_and_no_other(built):
    """A pack that says it was walked from this load's plan, for this GPU's multiprocessors, with
    this torch, spares the load its walk; anything else is walked as before."""
    art, path, (_, pack_path, _, _) = built
    pack = packs.Pack.open(pack_path, 90, None, named=True)
    plan = plan_digest(read_artifact(path))
    assert plan == plan_digest(art)  # in memory at compile, and read back from its file at load
    assert pack.covers(plan, H100.multiprocessors)
    assert not pack.covers(plan, 114)  # an H100 PCIe: kernels sized by multiprocessors may differ
    other = compile_model(SAMPLES / "mobilenet.pt", input_specs(["1x3x32x32"]), device="cpu").artifact()
    assert plan_digest(other) != plan and not pack.covers(plan_digest(other), H100.multiprocessors)
    pack.manifest["torch"] = "2.0.0"
    assert not pack.covers(plan, H100.multiprocessors)


def test_a_covered_load_does_not_walk_and_takes_each_kernel_as_it_launches(built, tmp_path, monkeypatch):
    art, path, (_, pack_path, _, _) = built
    launches = _launches(art)
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(binaries, "enabled", lambda device: True)
    monkeypatch.setattr(binaries, "Binary", _Loaded)
    monkeypatch.setattr(binaries, "_record_path", lambda d, s, dev: tmp_path / "cache" / "binaries" / f"r{d}{hash(s)}.json")
    monkeypatch.setattr(binaries, "_TRUSTED", [])
    monkeypatch.setattr(prebuild, "local_target", lambda device: H100)
    monkeypatch.setattr(prebuild, "walk", lambda *a, **k: pytest.fail("a covered load walked"))
    pack = packs.Pack.open(pack_path, 90, None, named=True)
    done = prebuild.before_load(read_artifact(path), torch.device("cuda", 0), pack, quiet=True)
    assert not done.walked and done.found == len(pack) and done.from_pack == done.built == 0
    (source, signature), (kernel, args, constants) = next(iter(launches.items()))
    got = binaries.recall(source, signature, args, constants)  # the cache folder is empty: the pack's
    assert isinstance(got, _Loaded) and pack.taken == 1
    assert binaries.recall(source + "0", signature, args, constants) is None  # no binary for another source
    assert done.settle() == [] and done.from_pack == 1
    # a second load of the same pack (another batch size, say) counts what the first pack object takes
    again = prebuild.before_load(read_artifact(path), torch.device("cuda", 0),
                                 packs.Pack.open(pack_path, 90, None, named=True), quiet=True)
    assert again.pack is pack and binaries._TRUSTED == [pack]
    (other_source, other_signature), (_, other_args, other_constants) = list(launches.items())[1]
    assert isinstance(binaries.recall(other_source, other_signature, other_args, other_constants), _Loaded)
    assert again.settle() == [] and again.from_pack == 1
    # the next recall finds it in the cache folder, where the pack left it
    monkeypatch.setattr(binaries, "_TRUSTED", [])
    binaries._READY.clear()
    assert isinstance(binaries.recall(source, signature, args, constants), _Loaded)
    # a pack walked from another plan (here: one that does not say) is walked
    walked = []
    monkeypatch.setattr(prebuild, "walk", lambda *a, **k: walked.append(1) or {})
    del pack.manifest["plan"]
    assert prebuild.before_load(read_artifact(path), torch.device("cuda", 0), pack, quiet=True).walked and walked


def test_an_untrusted_pack_is_never_used(built, tmp_path, monkeypatch):
    art, path, (_, pack_path, _, _) = built
    used = []
    monkeypatch.setattr(prebuild, "before_load", lambda a, d, pack, only: used.append(pack) or prebuild.Prebuilt())
    monkeypatch.setattr(prebuild, "local_target", lambda device: H100)
    monkeypatch.delenv(packs.KEY_ENV, raising=False)
    # beside the artifact, not named, no key configured: not even opened
    prebuild.for_load(art, torch.device("cuda", 0), None, None, str(path))
    assert used == [None]
    # a key configured, the pack unsigned: not used, named or not
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    monkeypatch.setenv(packs.KEY_ENV, str(key))
    prebuild.for_load(art, torch.device("cuda", 0), None, str(pack_path), str(path))
    prebuild.for_load(art, torch.device("cuda", 0), None, None, str(path))
    assert used == [None, None, None]
    with pytest.raises(packs.PackMiss, match="not signed with the key"):
        packs.Pack.open(pack_path, 90, packs.read_key(str(key)), named=True)
    with pytest.raises(packs.PackMiss, match="used only where NIMBLE_KERNEL_KEY names"):
        packs.Pack.open(pack_path, 90, None, named=False)


def test_a_signed_pack_is_used_beside_the_artifact_and_a_rewritten_one_is_not(built, tmp_path, monkeypatch):
    art, path, (_, pack_path, _, _) = built
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    pack = packs.Pack.open(pack_path, 90, None, named=True)
    with open(pack_path, "rb") as f:
        blobs = f.read()[pack.start:]
    entries = [packs.Entry(s, g, e["record"], blobs[e["offset"]:e["offset"] + e["size"]])
               for (s, g), e in pack.index.items()]
    signed = tmp_path / f"{path.name}{packs.SUFFIX}"
    packs.write(signed, 90, entries, packs.read_key(str(key)))
    assert len(packs.Pack.open(signed, 90, packs.read_key(str(key)), named=False)) == len(entries)
    used = []
    monkeypatch.setattr(prebuild, "before_load", lambda a, d, p, only: used.append(p) or prebuild.Prebuilt())
    monkeypatch.setattr(prebuild, "local_target", lambda device: H100)
    monkeypatch.setenv(packs.KEY_ENV, str(key))
    prebuild.for_load(art, torch.device("cuda", 0), None, None, str(tmp_path / path.name))
    assert len(used) == 1 and used[0] is not None and used[0].path == signed
    # the manifest rewritten without the key (a binary's sha256 changed to match a new binary): refused
    data = signed.read_bytes()
    head = json.loads(data[len(packs.MAGIC) + 8:pack_start(data)])
    head["entries"][0]["record"]["sha256"] = "0" * 64
    body = json.dumps(head, sort_keys=True).encode()
    forged = tmp_path / "forged.kernels"
    forged.write_bytes(packs.MAGIC + len(body).to_bytes(8, "little") + body + data[pack_start(data):])
    with pytest.raises(packs.PackMiss, match="not signed with the key"):
        packs.Pack.open(forged, 90, packs.read_key(str(key)), named=True)
    with pytest.raises(packs.PackMiss, match="not signed with the key"):
        packs.Pack.open(forged, 90, os.urandom(32), named=True)


def pack_start(data: bytes) -> int:
    return len(packs.MAGIC) + 8 + int.from_bytes(data[len(packs.MAGIC):len(packs.MAGIC) + 8], "little")


@pytest.mark.parametrize("content, why", [
    (b"", "not a nimble kernel pack"),
    (b"PK\x03\x04 a zip", "not a nimble kernel pack"),
    (packs.MAGIC + (2**40).to_bytes(8, "little") + b"{}", "manifest does not fit the file"),
    (packs.MAGIC + (4).to_bytes(8, "little") + b"[1,2", "manifest is not JSON"),
    (packs.MAGIC + (2).to_bytes(8, "little") + b"[]", "manifest is malformed"),
])
def test_a_crafted_pack_is_a_miss_in_one_line(tmp_path, content, why):
    path = tmp_path / "crafted.kernels"
    path.write_bytes(content)
    with pytest.raises(packs.PackMiss, match=why):
        packs.Pack.open(path, 90, None, named=True)


def test_an_entry_pointing_outside_the_file_is_a_miss(built, tmp_path):
    pack_path = built[2][1]
    data = pack_path.read_bytes()
    head = json.loads(data[len(packs.MAGIC) + 8:pack_start(data)])
    head["entries"][0]["offset"] = 2**40
    body = json.dumps(head, sort_keys=True).encode()
    path = tmp_path / "outside.kernels"
    path.write_bytes(packs.MAGIC + len(body).to_bytes(8, "little") + body + data[pack_start(data):])
    with pytest.raises(packs.PackMiss, match="malformed entry"):
        packs.Pack.open(path, 90, None, named=True)


def test_compile_writes_a_signed_pack_and_refuses_bad_options_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    out = tmp_path / "r.nimble"
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    result = invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", out,
                    "--gpu-arch", "sm_90", "--sign-with", key, "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    (made,) = doc["kernel_packs"]
    assert made["arch"] == "sm_90" and made["signed"] and made["kernels"] > 0 and not made["failed"]
    assert len(packs.Pack.open(made["path"], 90, packs.read_key(str(key)), named=False)) == made["kernels"]
    assert "sm_99" in one_line_error(invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "-o", out,
                                            "--gpu-arch", "sm_99"), 2)
    assert "give --gpu-arch too" in one_line_error(invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32",
                                                          "-o", out, "--sign-with", key), 2)
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    assert "16 to 4096 bytes" in one_line_error(invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "-o", out,
                                                       "--gpu-arch", "sm_90", "--sign-with", short), 2)
    assert "no such file" in one_line_error(invoke("run", out, "--random", "--kernels", tmp_path / "none"), 2)


def test_targets_parse_as_documented():
    assert aot.targets("sm_90,sm_80") == [aot.Target(90, 132), aot.Target(80, 108)]
    assert aot.targets("sm_90:114") == [aot.Target(90, 114)]


def test_a_walk_that_fails_never_fails_the_load(monkeypatch):
    """The prebuild is an optimisation: where its walk raises, the load goes on and each kernel
    builds as it first runs (one line says so)."""
    monkeypatch.setattr(binaries, "enabled", lambda device: True)
    monkeypatch.setattr(prebuild, "local_target", lambda device: H100)

    def broken(*args, **kwargs):
        raise RuntimeError("an op the walk cannot take")
    monkeypatch.setattr(prebuild, "walk", broken)
    done = prebuild.before_load(object(), torch.device("cuda", 0), None, quiet=True)
    assert done.found == done.built == 0 and "an op the walk cannot take" in done.notes[0]
    assert "each builds as it first runs" in done.notes[0]


def test_a_binary_that_inflates_past_its_record_is_refused(built, tmp_path, monkeypatch):
    """A crafted entry whose stored bytes inflate to far more than its record's size: inflated
    no further than that size plus one, then refused."""
    art, _, (_, pack_path, _, _) = built
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(binaries, "Binary", _Loaded)
    pack = packs.Pack.open(pack_path, 90, None, named=True)
    source, signature, entry = _first(pack)
    bomb = packs.Entry(source, signature, entry["record"], b"\0" * (64 * 2**20))
    path = tmp_path / "bomb.kernels"
    packs.write(path, 90, [bomb])
    crafted = packs.Pack.open(path, 90, None, named=True)
    assert crafted.index[source, signature]["size"] < 2**20  # 64 MiB stored in well under 1 MiB
    kernel, args, constants = _launches(art)[source, signature]
    assert crafted.take(source, signature, args, constants, torch.device("cuda", 0)) is None
    assert "does not match its recorded sha256" in crafted.refused[0]


def test_run_and_bench_say_where_the_kernels_came_from():
    from nimble.cli.common import describe_kernels

    done = prebuild.Prebuilt(found=31, cached=2, from_pack=27, built=2, seconds=1.234)
    assert describe_kernels(done.document()) == ("31 kernels found before the first op: 2 from the cache, 27 from "
                                                 "the pack, 2 built here (1.23 s)")
    assert describe_kernels(None) is None and describe_kernels(prebuild.Prebuilt().document()) is None


def test_a_kernel_triton_cannot_read_fails_alone(built):
    """A launch whose kernel text Triton cannot read is one failure line; the others build."""
    art = built[0]
    launches = list(_launches(art).values())[:2]
    broken = type(launches[0][0])("def kernel(:\n", "0" * 32)  # a `generated.Generated` of text that is no Python
    got, failed, _ = aot.build_all([(broken, *launches[0][1:]), launches[1]], 90, 2)
    assert len(got) == 1 and len(failed) == 1 and "SyntaxError" in failed[0]


def test_what_a_walk_changes_holds_for_the_walking_thread_only():
    """The walk answers torch.cuda's questions and makes claimed tensors for its own thread; any
    other thread (a load beside it, a server) sees torch as it is."""
    import threading

    from nimble.runtime.base import claimed as claims

    asked = prebuild._for_walk(lambda: "as the target", lambda: "as CUDA")
    made = claims._factory(lambda *a, **k: torch.empty(a, device="meta") if k["device"] == "meta" else k["device"])
    elsewhere = {}

    def other_thread():
        elsewhere["asked"], elsewhere["made"] = asked(), made(3, device="cuda")
    with claims.walk([], torch.device("cuda", 0)):
        here = asked(), type(made(3, device="cuda")).__name__
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert here == ("as the target", "Claimed")
    assert elsewhere == {"asked": "as CUDA", "made": "cuda"}
    assert asked() == "as CUDA" and made(3, device="cuda") == "cuda"


def test_a_text_key_signs_and_checks_alike(tmp_path):
    """A key file written as text (a trailing newline) reads the same at signing and checking."""
    key = tmp_path / "key"
    key.write_text("a secret of more than sixteen characters\n")
    assert packs.read_key(str(key)) == b"a secret of more than sixteen characters"


def test_a_pack_that_cannot_be_built_leaves_the_artifact_and_says_so(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("Triton refused the kernel")
    monkeypatch.setattr(prebuild, "ahead", broken)
    out = tmp_path / "r.nimble"
    line = one_line_error(invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", out,
                                 "--gpu-arch", "sm_90"), 1)
    assert "r.nimble is written and complete" in line and "Triton refused the kernel" in line
    assert out.is_file() and not Path(f"{out}{packs.SUFFIX}").exists()


def test_a_build_that_fails_on_a_thread_is_tried_once_more_alone(built, monkeypatch):
    """A build that failed beside others (a Triton whose state threads share) gets one more try."""
    art = built[0]
    launches = list(_launches(art).values())[:3]
    real, tries = aot.build, []

    def flaky(kernel, args, constants, arch):
        tries.append(kernel.digest)
        if len(tries) == 1:  # the first build, whichever thread runs it
            raise SystemError("AST constructor recursion depth mismatch (before=36, after=31)")
        return real(kernel, args, constants, arch)
    monkeypatch.setattr(aot, "build", flaky)
    got, failed, _ = aot.build_all(launches, 90, 2)
    assert len(got) == 3 and failed == [] and len(tries) == 4  # three builds and one more try


def test_serve_takes_one_trusted_pack_per_artifact(built, tmp_path, monkeypatch):
    """`nimble serve A B --kernels PA --kernels PB`: each replica loads its artifact with its pack;
    a count that does not match the artifacts, or a pack that is not there, is one line before
    anything starts."""
    art, path, (_, pack_path, _, _) = built
    other = tmp_path / "other.nimble"
    other.write_bytes(path.read_bytes())
    says = one_line_error(invoke("serve", path, other, "--kernels", pack_path, "--device", "cpu"), 2)
    assert "one pack per ARTIFACT" in says and "2 artifact(s), 1 pack(s)" in says
    says = one_line_error(invoke("serve", path, "--kernels", tmp_path / "gone.kernels", "--device", "cpu"), 2)
    assert "no such file" in says

    from nimble.runtime import opening
    from nimble.serve.replica import Replica

    asked = {}
    real = opening.load

    def load(*args, **kwargs):
        asked.update(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(opening, "load", load)
    Replica(path, "resnet", "cpu", kernels=str(pack_path))
    assert asked["kernels"] == str(pack_path)


def test_kernels_built_in_processes_are_the_ones_threads_build(built):
    """Large sets on many cores build in spawned processes, which get each call as plain values
    (dtype and address modulo 16 per tensor): the records and binaries are the threads' own."""
    art = built[0]
    launches = list(_launches(art).values())[:3]
    apart, failed, _ = aot.build_described(launches, 90, 2, processes=2)
    threads, _, _ = aot.build_described(launches, 90, 2, processes=0)
    # and on processes started before the set was known (a cold load starts them beside its walk)
    assert aot.start_builders(2) is None  # not on fewer than PROCESSES_FROM_CORES cores
    builders = aot.Builders(2)
    try:
        early, failed_early, _ = aot.build_described(launches[:2], 90, 2, builders=builders)
    finally:
        builders.close()
    assert not failed and not failed_early and len(apart) == len(threads) == 3 and len(early) == 2
    def name(launch):
        return launch[0].digest, binaries.specialisation(launch[1], launch[2])
    by_launch = {name(launch): got for launch, got in threads}
    for launch, got in apart + early:
        assert got is not None and got == by_launch[name(launch)]
    closed, _, _ = aot.build_described(launches[:1], 90, 1, builders=builders)  # a closed pool: the threads build
    assert len(closed) == 1 and closed[0][1] == by_launch[name(launches[0])]
    assert aot._call_of((torch.empty(4)[1:], 3, None)) == (("tensor", "float32", 4), ("value", 3), ("value", None))


def test_build_processes_never_run_the_users_script_again(tmp_path):
    """A script that loads without an `if __name__ == "__main__":` guard runs once: the build
    processes import nimble's build loop, not the script (`multiprocessing`'s spawned workers
    would run it again). A job that fails comes back as its one line; closing kills them."""
    marker = tmp_path / "ran.txt"
    script = tmp_path / "user_script.py"
    script.write_text(f"""
import sys
with open({str(marker)!r}, "a") as f:
    f.write("ran\\n")
from nimble.runtime.kernels import aot
builders = aot.Builders(2)
answers = builders.run([("not a kernel", (), {{}}, 90), ("nor this", (), {{}}, 90)])
builders.close()
print(all(isinstance(a, str) and a for a in answers), builders.run([("x", (), {{}}, 90)]))
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "[None]"], done.stdout
    assert marker.read_text() == "ran\n"
    # a worker that dies takes no more jobs, and the ones it did not answer come back as None
    builders = aot.Builders(1)
    builders._procs[0].kill()
    builders._procs[0].wait()
    try:
        assert builders.run([("x", (), {}, 90), ("y", (), {}, 90)]) == [None, None]
    finally:
        builders.close()


def test_a_crafted_walked_field_never_covers_a_load(built):
    """The manifest's plan and multiprocessor count are compared, never trusted for their type: a
    crafted value of another type is a walk, as a pack that does not say is."""
    art, path, (_, pack_path, _, _) = built
    plan = plan_digest(read_artifact(path))
    for field, value in [("plan", {"$": plan}), ("plan", [plan]), ("plan", None), ("multiprocessors", "132"),
                         ("multiprocessors", 132.5), ("multiprocessors", [132])]:
        pack = packs.Pack.open(pack_path, 90, None, named=True)
        pack.manifest[field] = value
        assert not pack.covers(plan, H100.multiprocessors), (field, value)
