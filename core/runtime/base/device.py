"""Which device a run uses: "auto" picks CUDA where present, else the CPU with a notice."""

from __future__ import annotations

import torch


def resolve_device(device: str) -> tuple[torch.device, str | None]:
    """(device, notice) for --device: auto picks CUDA when present, else the CPU with a notice."""
    from ...errors import UsageError
    from ...specs import check_device_name

    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), None
        return torch.device("cpu"), "no CUDA device here: running the op list serially on the CPU"
    check_device_name(device)
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: this machine has no CUDA device; use --device cpu or auto")
    return torch.device(device), None
