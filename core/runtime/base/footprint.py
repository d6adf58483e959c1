"""What a loaded artifact holds on its GPU, by kind, from the caching allocator's own books
(`torch.cuda.memory_snapshot()`), so that the kinds add up to what the process grew by while
loading: the number `nvidia-smi` shows for it, less the CUDA context.

- `weights`, `arena`, `inputs`: the tensors the plan names;
- `outside_arena`: results the captured graph holds in its pool rather than at their planned
  offset (cuDNN's fused convolutions allocate their own output);
- `pool_free`: the graph pool's segments less what is allocated in them: op workspaces and
  temporaries the replay reuses, and the slack of its segments. The pool keeps a segment per stream that allocated in it, which
  `pool_segments_per_stream` counts;
- `other_allocated`: anything else the load left allocated: the padding of the load's regions
  (`regions.py`: alignment, and a region between 1 and 10 MiB asks for 10), and cuBLAS workspaces: cuBLAS
  keeps one per CUDA stream that multiplied matrices (32 MiB each on Hopper by default), which
  PyTorch holds for the whole process and the captured graph uses; a later load on the same
  streams reuses them (PyTorch hands out streams from a pool of 32). Folding the planned streams
  onto fewer CUDA streams (`plan/capped.fold`) keeps their number down. Also the workspaces of the
  cuDNN graphs (`cudnn_graph.Workspaces`: one per CUDA stream, most plans need none);
- `cached`: the free parts of segments outside the pool that the load grew. Whole free segments
  go back to the device at the end of a load (`torch.cuda.empty_cache()`), so what stays is the
  free part of a segment that also holds something the load keeps. It is negative where the load
  used room in segments the process had reserved before it.

`growth` is the process's reserved memory after the load less before it: the sum of the kinds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

KINDS = ("weights", "arena", "inputs", "outside_arena", "pool_free", "other_allocated", "cached")


@dataclass
class Footprint:
    weights: int = 0
    arena: int = 0
    inputs: int = 0
    outside_arena: int = 0
    pool_free: int = 0
    other_allocated: int = 0
    cached: int = 0
    growth: int = 0
    pool_segments_per_stream: dict[str, int] = field(default_factory=dict)  # stream -> pool segments

    def document(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Mark:
    """The allocator's totals on one device at one moment."""

    reserved: int
    allocated: int

    @staticmethod
    def now(device: torch.device) -> Mark:
        torch.cuda.synchronize(device)
        return Mark(torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))


def measure(device: torch.device, before: Mark, planned: dict[str, int], pools, outside_arena: int) -> Footprint:
    """The footprint on `device` since `before`: `planned` gives the bytes of weights, arena and
    inputs; `pools` are the captured graphs' pools (empty: no graph); `outside_arena` the bytes of
    results the graphs hold outside the arena."""
    after = Mark.now(device)
    pool_reserved, pool_allocated, per_stream = pool_segments(device, pools)
    grown_allocated = after.allocated - before.allocated
    fp = Footprint(weights=planned["weights"], arena=planned["arena"], inputs=planned["inputs"],
                   outside_arena=outside_arena, pool_free=pool_reserved - pool_allocated,
                   growth=after.reserved - before.reserved, pool_segments_per_stream=per_stream)
    fp.other_allocated = grown_allocated - fp.weights - fp.arena - fp.inputs - fp.outside_arena
    fp.cached = fp.growth - grown_allocated - fp.pool_free  # free parts of segments outside the pool
    return fp


def pool_segments(device: torch.device, pools) -> tuple[int, int, dict[str, int]]:
    """The reserved and allocated bytes of the segments of `pools` (graph pools) on `device`, and
    their number per stream."""
    pools = {tuple(p) for p in pools}
    reserved, allocated, per_stream = 0, 0, {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    if pools:
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device") == index and tuple(seg.get("segment_pool_id", ())) in pools:
                reserved += seg["total_size"]
                allocated += seg["allocated_size"]
                stream = f"{seg.get('stream', 0):#x}"
                per_stream[stream] = per_stream.get(stream, 0) + 1
    return reserved, allocated, per_stream
