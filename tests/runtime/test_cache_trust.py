"""The cache folder is read as carefully as an artifact: a folder others can write is not used,
cache files must be small regular files, writes never follow a planted name, and kernels are
compiled from the text generated in this process, never imported from disk."""

import json
import os
import py_compile
import sys
import threading
import types

import pytest
import torch

from nimble.runtime.base import cache
from nimble.runtime.kernels import codegen
from nimble.runtime.kernels import fused as kernels, generated
from nimble.runtime.tune import choices as tuning


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    cache._WARNED.clear()
    return tmp_path / "cache"


def test_the_folder_is_made_private(root):
    assert cache.cache_dir() == root
    assert root.stat().st_mode & 0o777 == 0o700


def test_a_folder_others_can_write_is_not_used_and_said_once(root, capsys):
    root.mkdir(mode=0o700)
    os.chmod(root, 0o777)
    assert cache.cache_dir() is None and cache.cache_dir("kernels") is None
    assert capsys.readouterr().err.count("can be written by other users") == 1
    tuning.store("k", tuning.Choice(), {})
    assert tuning.cached("k") is None and not (root / "tuning.json").exists()


def test_tuning_round_trips_in_a_private_folder(root):
    tuning.store("k", tuning.Choice(layout="channels_last"), {"a": 1.0})
    assert tuning.cached("k") == tuning.Choice(layout="channels_last")
    capped = tuning.Choice(streams=f"at most {tuning.CAP}")
    tuning.store("c", capped, {})
    assert tuning.cached("c") == capped


def test_a_stream_setting_nimble_does_not_offer_is_a_miss(root):
    """A cache written by another version (another cap), or by hand: timed again, not obeyed."""
    tuning.store("k", tuning.Choice(streams="at most 7"), {})
    assert tuning.cached("k") is None


def test_a_fifo_is_a_miss_and_does_not_hang(root):
    root.mkdir(mode=0o700)
    os.mkfifo(root / "tuning.json")
    done = []
    worker = threading.Thread(target=lambda: done.append(tuning.cached("k")), daemon=True)
    worker.start()
    worker.join(10)
    assert done == [None]


@pytest.mark.parametrize("content", [b"[" * 200_000 + b"]" * 200_000, b" " * (2 * 2**20) + b"{}", b"\xff\xfe"])
def test_a_deep_huge_or_garbled_tuning_file_is_a_miss(root, content):
    root.mkdir(mode=0o700)
    (root / "tuning.json").write_bytes(content)
    assert tuning.cached("k") is None
    tuning.store("k", tuning.Choice(), {})  # and it is replaced by a good one
    assert tuning.cached("k") == tuning.Choice()


def test_writes_never_follow_a_planted_symlink(root, tmp_path):
    root.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (root / "tuning.json").symlink_to(victim)
    (root / f".tuning.{os.getpid()}.tmp").symlink_to(victim)  # the temp name nimble once used
    assert tuning.cached("k") is None  # a symlink is not read
    tuning.store("k", tuning.Choice(), {})
    assert victim.read_text() == "keep"
    assert not (root / "tuning.json").is_symlink() and tuning.cached("k") == tuning.Choice()


def test_the_table_stays_under_its_cap(root):
    timings = {f"candidate {n}": 1.0 for n in range(1000)}  # about 30 kB an entry
    for k in range(60):
        tuning.store(f"key {k}", tuning.Choice(), timings)
    assert (root / "tuning.json").stat().st_size <= tuning.MAX_TUNING_BYTES
    assert tuning.cached("key 59") == tuning.Choice() and tuning.cached("key 0") is None


@pytest.fixture
def fake_triton(monkeypatch):
    module = types.ModuleType("triton")
    module.__version__ = "0-test"
    module.jit = lambda fn: fn
    module.cdiv = lambda a, b: -(-a // b)
    language = types.ModuleType("triton.language")
    language.constexpr = int
    module.language = language
    monkeypatch.setitem(sys.modules, "triton", module)
    monkeypatch.setitem(sys.modules, "triton.language", language)


def test_a_planted_pyc_beside_a_matching_source_never_runs(root, tmp_path, fake_triton):
    x = torch.empty(4, device="meta")
    source = codegen.elementwise_source([("aten::relu.default", (x,), ())], torch.empty(4, device="meta"), [x], False, False)
    import hashlib

    digest = hashlib.sha256(f"{source}triton 0-test".encode()).hexdigest()[:32]
    folder = root / "kernels"
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(root, 0o700)
    mark = tmp_path / "ran"
    evil = f"open({str(mark)!r}, 'w')\n"
    evil += "#" * (len(source.encode()) - len(evil.encode()) - 1) + "\n"  # the same size as the source
    path = folder / f"k{digest}.py"
    path.write_text(evil)
    os.utime(path, (1_000_000_000, 1_000_000_000))
    py_compile.compile(str(path), invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    path.write_text(source)  # the source the cache expects, with the planted .pyc's size and time
    os.utime(path, (1_000_000_000, 1_000_000_000))
    hits = generated.STATS.source_hits
    generated.elementwise_launcher(source)
    assert not mark.exists()
    assert generated.STATS.source_hits == hits + 1  # the text matched; it was compiled from memory


@pytest.mark.parametrize("gemm_bias", ["evil", 1, None, ["separate"]])
def test_a_crafted_gemm_bias_in_the_tuning_cache_is_a_miss(root, gemm_bias):
    """The GEMM-bias setting read back from `tuning.json` must be one nimble knows, or the entry
    is ignored (and tuning times again) before anything runs with it."""
    tuning.store("k", tuning.Choice(gemm_bias="separate"), {})
    assert tuning.cached("k") == tuning.Choice(gemm_bias="separate")
    table = json.loads((root / "tuning.json").read_text())
    table["k"]["choice"]["gemm_bias"] = gemm_bias
    (root / "tuning.json").write_text(json.dumps(table))
    assert tuning.cached("k") is None


@pytest.mark.parametrize("content", [b"[" * 200_000 + b"]" * 200_000, b" " * (2 * 2**20) + b"{}", b"\xff\xfe",
                                     b'["not", "an", "object"]'])
def test_a_crafted_cudnn_plan_table_is_empty_and_replaced(root, content):
    """cudnn_plans.json is read through the same check as tuning.json before any entry is used
    (its entries are then rebuilt and checked on the GPU: tests/runtime/test_gpu_cudnn_graph.py)."""
    from nimble.runtime.kernels import cudnn_graph

    root.mkdir(mode=0o700)
    path = cudnn_graph._table_path()
    path.write_bytes(content)
    assert cache.read_table(path, cudnn_graph.MAX_PLAN_TABLE_BYTES) == {}
    cache.write_entry(path, "k", {"plan": None}, cudnn_graph.MAX_PLAN_TABLE_BYTES)
    assert cache.read_table(path, cudnn_graph.MAX_PLAN_TABLE_BYTES) == {"k": {"plan": None}}


def test_a_cudnn_plan_table_behind_a_symlink_is_not_read(root, tmp_path):
    from nimble.runtime.kernels import cudnn_graph

    root.mkdir(mode=0o700)
    planted = tmp_path / "planted.json"
    planted.write_text(json.dumps({"k": {"plan": "eng0"}}))
    cudnn_graph._table_path().symlink_to(planted)
    assert cache.read_table(cudnn_graph._table_path(), cudnn_graph.MAX_PLAN_TABLE_BYTES) == {}
