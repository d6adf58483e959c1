"""Issuing one candidate's op list on its streams, and capturing that into a CUDA graph.

`issue` runs every op in order on its stream, waiting on the planned events; on CUDA a result
outside the arena is dropped once its last reader is issued (`streams.release_plan`), so the
allocator hands its memory to a later result on the same stream instead of holding every one of
them. `capture` does the same inside a CUDA graph, forked from the capturing stream and joined
back to it. `make_blas_workspaces` gives each stream that will multiply matrices its cuBLAS
workspace before any op runs."""

from __future__ import annotations

import torch

from ...ops.execute import run_ops
from ..base import streams
from ..kernels.gemm import Gemm
from ..kernels.pooled_conv import SmallLinear
from ..pairs.run import PairedRun
from .order import IssueOrder

# ops that multiply matrices through cuBLAS (by the name of the aten op)
GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "linear", "matmul", "mv", "addmv", "dot", "einsum",
                   "tensordot"})


def issue(graph, placed, order: IssueOrder, env: dict, views: dict, device: torch.device, cuda_streams: list,
          kept: frozenset[int], validate: bool = False, around=None) -> dict[int, torch.Tensor]:
    """Issue every op of `placed` in `order` into `views`, on `cuda_streams` (none on the CPU:
    serially); `around(step)`, where given, wraps each op's step (the trace times them so). With
    `validate`, an op that fails is named with its source line. Returns `env` with every value."""
    cuda = device.type == "cuda"
    run = PairedRun(env, views, device, name_failures=validate,
                    release=streams.release_plan(graph, order.order, order.stream_of) if cuda else None,
                    kept=kept, pairs=order.pairs)
    run_ops(placed, run, order.order,
            lambda ops, step: streams.issue(ops, step if around is None else around(step), device, cuda_streams,
                                            order.stream_of, order.waits))
    return env


def capture(issue_all, first_stream: torch.cuda.Stream, device: torch.device, pool=None, dump: str | None = None):
    """`issue_all()` captured into a new CUDA graph on `first_stream` (in `pool`, a graph pool that
    members of a group share); returns (the graph, what `issue_all` returned)."""
    graph = streams.new_graph(debug=bool(dump))
    with streams.capturing(graph, first_stream, device, "the op list", "try an artifact compiled with --streams 1",
                           pool):
        env = issue_all()
    torch.cuda.synchronize(device)
    if dump:
        streams.write_dot(graph, dump)
    return graph, env


def make_blas_workspaces(placed, stream_of: list[int], cuda_streams: list, ready: set[int],
                         device: torch.device) -> set[int]:
    """cuBLAS keeps a workspace per CUDA stream for the whole process (32 MiB on Hopper), made at
    the stream's first matrix product. Made in the middle of a warm-up, it is carved out of a
    segment that a convolution's workspace has just freed, and the rest of that segment can
    never go back to the device (it stayed reserved: 69 MiB for inception_v3). So each stream
    that will multiply matrices makes it here, before any op runs, in a segment of its own.
    Float32 products (`gemm.Gemm`) mostly run as nimble's kernel and time cuBLAS on
    `timing.stream`: their streams get none here (one that falls back to cuBLAS makes its
    workspace in the warm-up). Returns the streams that have one now (`ready` and these)."""
    streams_of = {stream_of[p.op.id] for p in placed
                  if p.op.target.split("::")[-1].split(".")[0] in GEMMS and not isinstance(p.substitute, Gemm)
                  and not (isinstance(p.substitute, SmallLinear) and not p.substitute.calls_cublas)}
    for k in sorted(streams_of - ready):
        with torch.cuda.stream(cuda_streams[k]):
            one = torch.ones(2, 2, device=device)
            torch.mm(one, one)
            torch.addmm(one[0], one, one)  # cuBLASLt's, where PyTorch uses it for a bias
    return ready | streams_of
