"""IR names of dtypes and torch enums <-> the torch objects: one table, from `dtypes.py`."""

from __future__ import annotations

import torch

from .. import dtypes
from ..dtypes import STORABLE
from ..errors import UnsupportedError

DTYPES: dict[str, torch.dtype] = {d.name: getattr(torch, d.name) for d in STORABLE}  # from dtypes.py
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# TorchScript passes these enums as plain ints; c10's numbering.
SCALAR_TYPES = {d.scalar_type: d.name for d in STORABLE}
LAYOUTS = {0: torch.strided}
MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.preserve_format,
                  2: torch.channels_last, 3: torch.channels_last_3d}
ENUMS = {
    "layout": {str(v): v for v in LAYOUTS.values()},
    "memory_format": {str(v): v for v in MEMORY_FORMATS.values()},
}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedError(dtypes.refusal(str(dtype).removeprefix("torch."))) from None
