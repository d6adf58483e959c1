"""Many casts as one op: what a training step's joint graph holds after `passes/group_casts.py`,
and what it computes (aten's `_to_copy` of each tensor, on any device; `runtime/kernels/casts`
copies them a dozen or so to a kernel on CUDA).

    out0, out1, ... = cast_group((x0, x1, ...), dtype)

Each result is its tensor converted to `dtype`, as `_to_copy(x, dtype=dtype)` gives it.
"""

from __future__ import annotations

import torch

CAST_GROUP = "nimble::cast_group"


def cast_group(tensors, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(torch.ops.aten._to_copy.default(t, dtype=dtype) for t in tensors)

