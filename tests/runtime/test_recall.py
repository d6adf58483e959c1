"""Per-call kernel choices kept in the cache folder (`runtime/kernels/recall.py`): kept and recalled per
kind, call and machine; nothing kept without CUDA; a crafted entry recalled only in the shape its
caller expects; a later load of a 1x1 convolution pair takes the kept tile without timing,
builds nothing where the two ops apart were kept, and checks a kept tile before it runs it."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from nimble.runtime.kernels import pointwise_conv, recall

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
def test_a_later_load_keeps_or_drops_a_depthwise_prologue_without_timing(cache_folder, monkeypatch, faster, use_settings):
    """`FusedKernel._after_bare`: the first load times the pair against the two ops run whole and
    keeps the answer; a later load (new kernels) takes it untimed, with eager's result either way."""
    from nimble.runtime.kernels import fused as kernels, generated

    from .test_depthwise_conv import ShimKernel, expansion_then_depthwise, fused_kernel

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(kernels.timing, "on_stream", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(kernels.FusedKernel, "whole_on_cudnn", lambda self, body, out: None)
    use_settings(standalone_pointwise=False)
    monkeypatch.setattr(generated, "define", ShimKernel)
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


def stand_in(monkeypatch, module, launcher, times):
    """`module`'s kernels made by `launcher` (no source is built), none built yet, and its timing
    taking each function's time from `times` on no stream: the functions timed."""
    from nimble.runtime.kernels import generated

    monkeypatch.setattr(module, "launcher", launcher)
    monkeypatch.setattr(generated, "define", lambda source: source)
    monkeypatch.setattr(module, "_built", {})
    timed = []

    def graph_us(fn, device):
        timed.append(fn)
        fn()
        return next(times)
    monkeypatch.setattr(module.timing, "graph_us", graph_us)
    monkeypatch.setattr(module.timing, "on_stream", lambda device: contextlib.nullcontext())
    return timed


def choose_product(monkeypatch, times, wrong=()):
    """`gemm.Gemm._choose` for one call, its kernel a stand-in that computes the product (off by
    one on `wrong` tiles): (the choice, the tiles built, the functions timed)."""
    from nimble.runtime.kernels import gemm

    built = []

    def launcher(kernel, tile):
        built.append(tile)

        def launch(x, b, bias, out):
            torch.mm(x, b, out=out)
            out.add_(1.0 if tile in wrong else 0.0)
        return launch
    timed = stand_in(monkeypatch, gemm, launcher, times)
    g = torch.Generator().manual_seed(1)
    x, b = torch.randn(6, 8, generator=g), torch.randn(8, 5, generator=g)
    key = ("product", 6, 8, 5)
    return gemm.Gemm(0, "aten::mm.default", None)._choose(key, x, b, None, torch.empty(6, 5)), built, timed


@pytest.mark.parametrize("faster", [True, False])
def test_a_later_load_takes_the_kept_float32_product_without_timing(cache_folder, monkeypatch, faster):
    from nimble.runtime.kernels import gemm

    got, built, timed = choose_product(monkeypatch, iter([2.0, 1.0, 100.0 if faster else 0.5]))
    assert got == (gemm.TILES[1] if faster else None) and built == list(gemm.TILES) and len(timed) == 3
    again, built, timed = choose_product(monkeypatch, iter([]))
    assert again == got and timed == [] and built == ([gemm.TILES[1]] if faster else [])
    again, built, timed = choose_product(monkeypatch, iter([2.0, 100.0]), wrong={gemm.TILES[1]})
    if faster:  # the kept tile now disagrees: timed again, and the other one kept
        assert again == gemm.TILES[0] and built == [gemm.TILES[1], gemm.TILES[0]] and len(timed) == 2


def choose_attention(monkeypatch, times, wrong=()):
    """`small_attention.Attention._choose` for one call, its kernel a stand-in computing PyTorch's
    attention (off by one on `wrong` tiles): (whether it runs, the launcher kept, the tiles made
    into launchers, the functions timed)."""
    from nimble.runtime.kernels import small_attention

    made = []

    def launcher(kernel, tile=None):
        made.append(tile)

        def launch(q, k, v, mask, out):
            out.copy_(torch.nn.functional.scaled_dot_product_attention(q, k, v, mask) + (1.0 if tile in wrong else 0))
        launch.tile = tile
        return launch
    timed = stand_in(monkeypatch, small_attention, launcher, times)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 49, 16, generator=g) for _ in range(3))
    key = ("attention", 49)
    runs = small_attention.Attention(0, {})._choose(key, q, k, v, None, torch.empty(1, 2, 49, 16), False, 0.25)
    return runs, getattr(small_attention._built.get(key), "tile", "none"), made, timed


@pytest.mark.parametrize("faster", [True, False])
def test_a_later_load_takes_the_kept_attention_choice_without_timing(cache_folder, monkeypatch, faster):
    from nimble.runtime.kernels import small_attention

    tiles = small_attention.tiles(*(torch.empty(1, 2, 49, 16),) * 2)
    others = [t for t in tiles if small_attention.grid(*(torch.empty(1, 2, 49, 16),) * 2, t)
              != small_attention.grid(*(torch.empty(1, 2, 49, 16),) * 2)]
    assert others
    times = [5.0] + [4.0 if t == others[0] else 6.0 for t in others] + [100.0 if faster else 1.0]
    runs, tile, made, timed = choose_attention(monkeypatch, iter(times))
    assert runs is faster and tile == others[0] and len(timed) == len(others) + 2
    runs, tile, made, timed = choose_attention(monkeypatch, iter([]))
    assert runs is faster and timed == []
    assert made == ([None, others[0]] if faster else []) and tile == (others[0] if faster else "none")
    runs, tile, made, timed = choose_attention(monkeypatch, iter(times), wrong={others[0]})
    if faster:  # the kept tile now disagrees: timed again, another kept
        assert runs and tile == (others[1] if len(others) > 1 else None) and len(timed) == len(others) + 1


@pytest.mark.parametrize("crafted", [{"tile": [64.0, 64, 32, 4, 3]}, {"tile": [1, 2, 3, 4, 5]}, {"tile": "x"},
                                     {"runs": "yes", "tile": [9, 9, 9]}, [1, 2]])
def test_a_crafted_product_or_attention_entry_is_timed_again_not_trusted(cache_folder, monkeypatch, crafted):
    """A `kernel_choices.json` entry for a float32 product or attention in any other shape than
    the one written (a known tile in integers, a boolean) is passed over: the call is timed as
    on a first load, and the entry written again."""
    from nimble.runtime.kernels import gemm, small_attention

    choose_product(monkeypatch, iter([2.0, 1.0, 100.0]))
    choose_attention(monkeypatch, iter([5.0] + [6.0] * 8 + [100.0]))
    table = json.loads((cache_folder / recall.TABLE).read_text())
    assert len(table) == 2
    (cache_folder / recall.TABLE).write_text(json.dumps({key: crafted for key in table}))
    got, built, timed = choose_product(monkeypatch, iter([2.0, 1.0, 100.0]))
    assert got == gemm.TILES[1] and built == list(gemm.TILES) and len(timed) == 3
    tiles = small_attention.tiles(*(torch.empty(1, 2, 49, 16),) * 2)
    runs, tile, made, timed = choose_attention(monkeypatch, iter([5.0] + [6.0] * len(tiles) + [100.0]))
    assert runs and tile is None and len(timed) >= 2
    entries = json.loads((cache_folder / recall.TABLE).read_text()).values()
    assert all(isinstance(e, dict) and "tile" in e for e in entries)
