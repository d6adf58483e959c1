"""Many casts as one op: what a training step's joint graph holds after `passes/group_casts.py`,
and what it computes (aten's `_to_copy` of each tensor, on any device; a step copies them into
their buffers a few dozen to a kernel: `runtime/joint.cast_group_into`).

    out0, out1, ... = cast_group((x0, x1, ...), dtype)

Each result is its tensor converted to `dtype`, as `_to_copy(x, dtype=dtype)` gives it.
"""

from __future__ import annotations

import torch

CAST_GROUP = "nimble::cast_group"


def cast_group(tensors, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(torch.ops.aten._to_copy.default(t, dtype=dtype) for t in tensors)
