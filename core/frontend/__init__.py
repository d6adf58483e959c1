"""Frontends: a model file plus static input specs -> IR `Graph` and its weights.

Each frontend reads its format and emits through the one `GraphBuilder` (`builder.py`), which
types every device op and folds host work on constants. A frontend emits what the model says:
every rewrite of the graph is a pass (`passes/`, listed in `pipeline.REWRITES`).
- TorchScript: `torchscript` loads an archive and freezes its forward; `walker` interprets its
  graph once, folding host-side work (`hostops`).
- torch.export: `program` reads a `.pt2` archive (checked first by `archive`); `export` lowers
  its graph.
`finalize` makes what was emitted a `Graph`, with ordering edges for in-place writes.
A frontend never imports the runtime.
"""

from . import export
from .export import lower_program
from ..model_files import check_model_file
from .program import is_program, load_program
from .torchscript import Lowered, load_module, lower, lower_training, quiet_torchscript, source_of

__all__ = ["Lowered", "check_model_file", "export", "is_program", "load_module", "load_program", "lower", "lower_program",
           "lower_training", "quiet_torchscript", "source_of"]
