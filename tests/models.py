"""Tiny models that exercise one frontend behaviour each (scripted in the tests)."""

import torch
import torch.nn as nn


class DataDependentIf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


class ShapeIfAndLoop(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            x = x + 1
        for _ in range(3):
            x = x * 2
        return x.view(x.size(0), -1)


class UnsupportedOp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.inv(x)


class InPlaceThroughView(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x)
        v = y.view(-1)
        z = y * 2
        v.add_(1)
        return z + y


class ParallelLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(x)
