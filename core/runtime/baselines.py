"""What `nimble bench` times beside an artifact, built from the same op list and inputs:

- `eager`: the op list run one op at a time, serially, with no graph (the reference executor);
- `pytorch_graph_1stream`: a one-stream CUDA graph of it with activations in PyTorch's graph pool;
- `pytorch_graph_streams`: the planned multi-stream CUDA graph, activations in PyTorch's graph pool.

The last two exist on CUDA only, and show what the arena and the schedule each add.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .placed import reference
from .executable import Executable


@dataclass
class Baseline:
    replay: Callable[[], object]  # one inference on the inputs it was built for
    pool_bytes: int | None  # graph-pool memory its capture kept (CUDA graphs only)


def baselines(exe: Executable, inputs: list | None = None) -> dict[str, Baseline]:
    """The baselines of a loaded artifact, each ready to replay `inputs` (default: its stored
    sample input)."""
    weights = {k: t.to(exe.device) for k, t in exe.artifact.weights.items()}
    xs = [x.to(exe.device) for x in (exe.artifact.sample_inputs if inputs is None else inputs)]
    out = {"eager": Baseline(lambda: reference.run(exe.graph, weights, xs, exe.device), None)}
    if exe.device.type == "cuda":
        for name, single in (("pytorch_graph_1stream", True), ("pytorch_graph_streams", False)):
            torch.cuda.empty_cache()
            other = Executable(exe.artifact, "cuda", arena=False, single_stream=single)
            other(*xs)  # its input buffers now hold the same inputs as nimble's
            out[name] = Baseline(other.replay, other.stats.scratch_bytes)
    return out
