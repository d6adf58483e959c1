"""Which device a run uses: "auto" picks CUDA where present, else the CPU with a notice."""

from __future__ import annotations

import torch


def resolve_device(device: str) -> tuple[torch.device, str | None]:
    """(device, notice) for --device: auto picks CUDA when present, else the CPU with a notice."""
    from ..errors import UsageError

    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), None
        return torch.device("cpu"), "no CUDA device here: running the op list serially on the CPU"
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r}: use auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: this machine has no CUDA device; use --device cpu or auto")
    return torch.device(device), None
