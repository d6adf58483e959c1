"""Per-call kernel choices kept in the cache folder (`runtime/recall.py`): kept and recalled per
kind, call and machine; nothing kept without CUDA; a crafted entry recalled only in the shape its
caller expects; a later load of a 1x1 convolution pair takes the kept tile without timing,
builds nothing where the two ops apart were kept, and checks a kept tile before it runs it."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from nimble.runtime import pointwise_conv, recall

MACHINE = ("H-test", 9, 0, "torch", "triton", "code")


@pytest.fixture
def cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(recall, "_where", lambda device: MACHINE)
    return tmp_path / "cache"


def test_a_choice_is_kept_per_kind_call_and_machine(cache_folder, monkeypatch):
    device = torch.device("cpu")
    recall.keep("pointwise", ("call", 1), device, {"tile": [64, 64, 32, 4, 3]})
    assert recall.recalled("pointwise", ("call", 1), device) == {"tile": [64, 64, 32, 4, 3]}
    assert recall.recalled("pointwise", ("call", 2), device) is None
    assert recall.recalled("prologue", ("call", 1), device) is None
    monkeypatch.setattr(recall, "_where", lambda device: ("another GPU", *MACHINE[1:]))
    assert recall.recalled("pointwise", ("call", 1), device) is None


def test_nothing_is_kept_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recall.keep("pointwise", ("call",), torch.device("cpu"), {"tile": None})
    assert recall.recalled("pointwise", ("call",), torch.device("cpu")) is None
    assert not (tmp_path / "cache" / recall.TABLE).exists()


@pytest.mark.parametrize("content", ["not json", json.dumps([1, 2]), "x" * (recall.MAX_TABLE_BYTES + 1)])
def test_a_crafted_or_oversized_table_recalls_nothing(cache_folder, content):
    recall.keep("pointwise", ("call",), torch.device("cpu"), {"tile": None})
    (cache_folder / recall.TABLE).write_text(content)
    assert recall.recalled("pointwise", ("call",), torch.device("cpu")) is None


class Pair:
    """A stand-in pair for `Choices.tile`: `apart` writes the right result; `fused(tile)`
    counts its builds and writes the right result, or a wrong one for `wrong` tiles."""

    def __init__(self, wrong=()):
        self.out = torch.zeros(2, 16, 4, 5).contiguous(memory_format=torch.channels_last)
        self.want = torch.randn(self.out.shape, generator=torch.Generator().manual_seed(0))
        self.fused_tiles, self.wrong = [], set(wrong)

    def apart(self):
        self.out.copy_(self.want)

    def fused(self, tile):
        self.fused_tiles.append(tile)
        self.out.copy_(self.want + (1.0 if tile in self.wrong else 0.0))
        return True


def choose(pair, monkeypatch, times):
    timed = []

    def graph_us(fn, device):
        timed.append(fn)
        return next(times)
    monkeypatch.setattr(pointwise_conv.timing, "graph_us", graph_us)
    monkeypatch.setattr(pointwise_conv.timing, "on_stream", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    notes = []
    got = pointwise_conv.Choices().tile(("key",), pair.out, pair.apart, pair.fused, notes.append)
    return got, len(timed), notes


@pytest.mark.parametrize("faster", [True, False])
def test_a_later_load_takes_the_kept_choice_without_timing(cache_folder, monkeypatch, faster):
    first = Pair()
    two = pointwise_conv.tiles(40, 16)
    got, timed, _ = choose(first, monkeypatch, iter([1.0, 2.0, 100.0 if faster else 0.5]))
    assert got == (two[0] if faster else None) and timed == 3 and len(first.fused_tiles) == 2
    later = Pair()
    again, timed, notes = choose(later, monkeypatch, iter([]))  # no timing at all
    assert again == got and timed == 0 and notes == []
    assert later.fused_tiles == ([two[0]] if faster else [])  # only the kept tile built and checked


def test_a_kept_tile_that_disagrees_or_is_unknown_is_timed_again(cache_folder, monkeypatch):
    two = pointwise_conv.tiles(40, 16)
    choose(Pair(), monkeypatch, iter([1.0, 2.0, 100.0]))
    got, timed, notes = choose(Pair(wrong={two[0]}), monkeypatch, iter([1.0, 100.0]))
    assert got == two[1] and timed == 2 and len(notes) == 2  # the kept tile, then timing it again
    table = json.loads((cache_folder / recall.TABLE).read_text())
    for crafted in ([1, 2, 3, 4, 5], [*two[1][:-1], float(two[1][-1])], "tile"):  # unknown; a float; no list
        for entry in table.values():
            entry["tile"] = crafted
        (cache_folder / recall.TABLE).write_text(json.dumps(table))
        pair = Pair()
        got, timed, _ = choose(pair, monkeypatch, iter([1.0, 2.0, 100.0]))
        assert got == two[0] and timed == 3 and pair.fused_tiles == list(two)  # timed again, nothing else built
        table = json.loads((cache_folder / recall.TABLE).read_text())


@pytest.mark.parametrize("faster", [True, False])
def test_a_later_load_keeps_or_drops_a_depthwise_prologue_without_timing(cache_folder, monkeypatch, faster):
    """`FusedKernel._after_bare`: the first load times the pair against the two ops run whole and
    keeps the answer; a later load (new kernels) takes it untimed, with eager's result either way."""
    from nimble.runtime import kernels

    from .test_depthwise_conv import ShimKernel, expansion_then_depthwise, fused_kernel

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(kernels.timing, "on_stream", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(kernels.FusedKernel, "whole_on_cudnn", lambda self, body, out: None)
    monkeypatch.setattr(kernels, "STANDALONE_POINTWISE", False)
    monkeypatch.setattr(kernels, "define", ShimKernel)
    _, _, expand, mid, depthwise, out, want = expansion_then_depthwise(torch.Generator().manual_seed(3), 16,
                                                                        (6, 5), 1)
    timed = []
    for load in range(2):
        times = iter([1.0, 2.0] if faster else [2.0, 1.0])  # the pair's, then whole

        def graph_us(fn, device):
            timed.append(load)
            fn()
            return next(times)
        monkeypatch.setattr(kernels.timing, "graph_us", graph_us)
        producer, consumer = fused_kernel(1, expand), fused_kernel(2, depthwise)
        producer.bare, consumer.after_bare = True, producer
        assert producer([expand], mid) is mid and consumer([depthwise], out) is out
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        assert producer.bare is faster
    assert timed == [0, 0]  # the second load timed nothing
