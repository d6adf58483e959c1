"""The memory one load holds for its plan: the weights (as stored, and the convolution weights'
channels_last copies), the arena and one static buffer per input, allocated in a few regions
(`base/regions.py`), or borrowed from a lender (another batch size of the same artifact); and
the bytes the plan names, checked against a memory budget before anything is allocated."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import ExecutionError, UsageError
from ...ir import WEIGHT, Graph
from ...ops import types
from ..base import regions
from ..kernels import gemm
from .choice import conv_weights


@dataclass
class Buffers:
    stored_weights: dict[int, torch.Tensor] = field(default_factory=dict)  # value id -> weight, as stored
    channels_last_weights: dict[int, torch.Tensor] = field(default_factory=dict)  # the convolution weights, so laid
    arena: torch.Tensor | None = None
    inputs: list[torch.Tensor] = field(default_factory=list)


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def planned_bytes(graph: Graph, weights: dict, arena: int, with_arena: bool) -> dict[str, int]:
    """Bytes of the tensors the plan names: weights, arena and inputs."""
    return {"weights": sum(t.numel() * t.element_size() for t in weights.values()),
            "arena": arena if with_arena else 0,
            "inputs": sum(graph.values[i].spec.nbytes for i in graph.inputs)}


def check_budget(name: str, max_memory: int | None, planned: dict[str, int]) -> None:
    """Refuse, in one line and before anything is allocated, a plan above `max_memory` bytes."""
    if max_memory is not None and (isinstance(max_memory, bool) or not isinstance(max_memory, int)
                                   or max_memory < 1):
        raise UsageError(f"max_memory must be a positive number of bytes, got {max_memory!r}")
    need = sum(planned.values())
    if max_memory is not None and need > max_memory:
        raise ExecutionError(f"{name} needs {mib(need)} for its weights, arena and inputs alone, above "
                             f"the memory budget of {mib(max_memory)}; nothing was allocated. Raise the budget, "
                             "or compile for a smaller batch")


def allocate(graph: Graph, weights: dict[str, torch.Tensor], device: torch.device, arena_bytes: int) -> Buffers:
    """The artifact's `weights` (by name), an arena of `arena_bytes` and the input buffers on
    `device`. On CUDA, three allocations (`regions.py`): the weights every layout reads, with the
    arena and the input buffers; the convolution weights; and their channels_last copies (made
    once, here, for every candidate that lays them out so). Whichever layout is chosen, the
    convolution weights it does not keep are one whole allocation, which goes back to the device.
    On the CPU the artifact's own tensors: nothing to copy."""
    by_id = {v.id: weights[v.name] for v in graph.values if v.kind == WEIGHT}
    inputs = [torch.zeros(graph.values[i].spec.shape, dtype=types.DTYPES[graph.values[i].spec.dtype])
              for i in graph.inputs]
    need = arena_bytes + sum(t.numel() * t.element_size() for t in weights.values())
    try:
        if device.type == "cuda":
            convs = conv_weights(graph)
            kept = regions.pack({**{k: t for k, t in by_id.items() if k not in convs},
                                 **{("input", k): x for k, x in enumerate(inputs)}}, device,
                                blank={"arena": max(arena_bytes, 1)},
                                strides={k: (1, by_id[k].shape[0]) for k in gemm.k_major_weights(graph)})
            stored = {**{k: t for k, t in kept.items() if isinstance(k, int)},
                      **regions.pack({k: t for k, t in by_id.items() if k in convs}, device)}
            return Buffers(stored, regions.pack({k: stored[k] for k in sorted(convs)}, device, torch.channels_last),
                           kept["arena"], [kept["input", k] for k in range(len(inputs))])
        return Buffers({k: t.to(device) for k, t in by_id.items()}, {},
                       torch.empty(max(arena_bytes, 1), dtype=torch.uint8, device=device), inputs)
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError):  # RuntimeError: the CPU allocator
        raise ExecutionError(f"out of {'GPU ' if device.type == 'cuda' else ''}memory while loading: the weights "
                             f"and arena need {need} bytes ({need / 2**20:.1f} MiB); free memory on {device} or use "
                             "a smaller batch") from None


def borrow(graph: Graph, lender_weights: dict[str, torch.Tensor], arena: torch.Tensor,
           device: torch.device) -> Buffers:
    """The lender's weights (by name, as it runs them: its chosen layout) and arena; input buffers
    of this plan's own."""
    try:
        inputs = [torch.zeros(graph.values[i].spec.shape, dtype=types.DTYPES[graph.values[i].spec.dtype],
                              device=device) for i in graph.inputs]
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError):
        raise ExecutionError(f"out of memory on {device} while loading the input buffers") from None
    return Buffers({v.id: lender_weights[v.name] for v in graph.values if v.kind == WEIGHT}, {}, arena, inputs)
