"""`tools/out_layouts.py`: every aten out= kernel that a small step's ops write through into a buffer
of another memory format is either right or kept apart by the step (`placement.STRIDES_IGNORED`,
`LAYOUT_BOUND`, `COPYING_OUT`), on the CPU and on CUDA. PyTorch's out= kernels that ignore a
buffer's strides differ by device (softmax and exact GELU on the CPU; max and average pooling on
CUDA): a new torch may add some, which this finds before a model's gradients go wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import out_layouts  # noqa: E402


class Pools(torch.nn.Module):
    """Max and average pooling, a 4-D softmax and exact GELU on 4-D maps: the ops whose out= kernels
    have written buffers of another layout wrong."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.mix = torch.nn.Conv2d(8, 8, 1)
        self.head = torch.nn.Linear(8, 10)

    def forward(self, x):
        y = torch.nn.functional.max_pool2d(torch.relu(self.stem(x)), 2)
        y = torch.nn.functional.avg_pool2d(y, 3, 2, 1)
        y = torch.nn.functional.gelu(self.mix(y))
        n, c, h, w = y.shape
        scores = torch.softmax(y.reshape(n, 2, c // 2, h * w), -1).reshape(n, c, h, w)
        return self.head((y * scores).mean((2, 3)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_out_kernel_a_step_writes_through_is_right_or_kept_apart(device):
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 16, 16, device=device), torch.randint(0, 10, (2,), device=device)
    found: dict = {}
    out_layouts.check_module("pools", Pools().to(device), x, y, found)
    assert not [key for key, (_, _, guarded) in found.items() if not guarded]


def test_it_finds_a_kernel_that_writes_another_layout_wrong(monkeypatch):
    """With softmax's guard taken away, the CPU's softmax out= kernel into a channels_last buffer is
    found and named as not guarded (torch's CPU kernel writes it 0.9 off or more)."""
    from nimble.runtime.placed import placement

    bound = {k: v for k, v in placement.LAYOUT_BOUND.items() if "softmax" not in k}
    monkeypatch.setattr(placement, "LAYOUT_BOUND", bound)
    torch.manual_seed(0)
    found: dict = {}
    out_layouts.check_module("pools", Pools(), torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,)), found)
    assert any(target == "aten::_softmax.default" and not guarded for (target, _, _), (_, _, guarded) in found.items())
