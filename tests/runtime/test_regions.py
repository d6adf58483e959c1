"""One allocation per group of tensors a load holds (`runtime/base/regions.py`)."""

import torch

from nimble.runtime.base import regions

CPU = torch.device("cpu")


def test_every_tensor_is_an_aligned_copy_inside_one_allocation():
    g = torch.Generator().manual_seed(0)
    tensors = {0: torch.randn(3, 4, generator=g), 1: torch.randn(2, 3, 5, 5, generator=g), 2: torch.arange(7),
               3: torch.randn(4, 3, generator=g).t(), 4: torch.zeros(0, 3), 5: torch.randn(3).expand(4, 3),
               "x": torch.ones(5, dtype=torch.bool)}
    packed = regions.pack(tensors, CPU)
    storages = {t.untyped_storage().data_ptr() for t in packed.values() if t.numel()}
    assert len(storages) == 1
    base = next(iter(storages))
    for k, t in tensors.items():
        got = packed[k]
        assert torch.equal(got, t) and got.dtype == t.dtype and (got.data_ptr() != t.data_ptr() or not t.numel())
        assert got.stride() == torch.empty_like(t, device="meta").stride()  # as t.to(device) lays it out
        assert (got.data_ptr() - base) % regions.ALIGN == 0 or not got.numel()
    packed[0].fill_(9)  # views of their own bytes: writing one leaves the others alone
    assert torch.equal(packed[1], tensors[1]) and torch.equal(packed[3], tensors[3])


def test_channels_last_copies_and_blank_room():
    w = torch.randn(4, 3, 2, 2)
    packed = regions.pack({7: w}, CPU, torch.channels_last, blank={"arena": 1000})
    assert packed[7].is_contiguous(memory_format=torch.channels_last) and torch.equal(packed[7], w)
    arena = packed["arena"]
    assert arena.dtype == torch.uint8 and arena.numel() == 1000
    assert arena.untyped_storage().data_ptr() == packed[7].untyped_storage().data_ptr()
    assert arena.data_ptr() >= packed[7].data_ptr() + w.numel() * 4
    assert regions.pack({}, CPU) == {}


def test_a_group_between_one_and_ten_mib_asks_for_ten():
    small = regions.pack({0: torch.zeros(1000)}, CPU)[0]
    assert small.untyped_storage().nbytes() == 4096 - 4096 % regions.ALIGN  # 4000 bytes, aligned
    middle = regions.pack({0: torch.zeros(2**20)}, CPU)[0]  # 4 MiB
    assert middle.untyped_storage().nbytes() == regions.SEGMENT_OF_ITS_OWN
    large = regions.pack({0: torch.zeros(3 * 2**20)}, CPU)[0]  # 12 MiB
    assert large.untyped_storage().nbytes() == 12 * 2**20

