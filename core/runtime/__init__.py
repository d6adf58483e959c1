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

`tests/test_layering.py` holds the rule (DESIGN.md, "Runtime floors").

`Executable`, `load` and `Group` are imported on first use: a compile reads `base/compare.py` and
the reference runner (`placed/`) and nothing that loads or captures, and the whole runtime took
0.2 s of its imports."""

from importlib import import_module

_API = {"Executable": "executable", "load": "opening", "Group": "group"}

__all__ = list(_API)


def __getattr__(name: str):
    if name in _API:
        return getattr(import_module(f"{__name__}.{_API[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
