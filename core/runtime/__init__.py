"""Running an IR graph on a device, in floors that import only from the floors below them:

- `base/`: device, streams and capture, timers, the cache folder, settings;
- `kernels/`: the kernel library (generated Triton, cuDNN graphs, GEMM, attention, reductions);
- `placed/`: one op into its planned buffer, the preflight and the reference runner;
- `pairs/`: two ops that one kernel runs, chosen at load, one kind per module;
- `assemble/`: a candidate's buffers, issue order, fresh kernels and capture;
- `tune/`: the candidates and their search;
- on top: `loading.py` and `executable.py` (load an artifact, capture it into a CUDA graph on the
  planned streams and arena, replay it), `batched.py` (several batch sizes), `group.py`
  (artifacts that share one arena and run one at a time), `opening.py` (`load`), `training.py`
  (captured forward and backward on a live module), `trace.py` (the timeline `bench --trace`
  writes) and `baselines.py`.

`tests/test_layering.py` holds the rule (DESIGN.md, "Runtime floors")."""

from .executable import Executable
from .opening import load
from .group import Group

__all__ = ["Executable", "Group", "load"]
