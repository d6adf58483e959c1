"""Frontends: a model file plus static input specs -> IR `Graph` and its weights.

Each frontend reads its format and emits through the one `GraphBuilder` (`builder.py`), which
types every device op, folds host work on constants, and applies the rewrites that depend on what
was emitted before (`reuse.py`: common subexpressions, repeated views).
- TorchScript: `torchscript` loads an archive and freezes its forward; `walker` interprets its
  graph once, folding host-side work (`hostops`).
- torch.export: `program` reads a `.pt2` archive (checked first by `archive`); `export` lowers
  its graph, with the attention pattern (`attention`) and concatenation flattening (`concat`).
`finalize` drops dead ops, adds ordering edges for in-place writes and numbers the result densely.
A frontend never imports the runtime.
"""

from . import export
from .export import lower_program
from .program import is_program, load_program
from .torchscript import Lowered, load_module, lower, lower_training, quiet_torchscript, source_of

__all__ = ["Lowered", "export", "is_program", "load_module", "load_program", "lower", "lower_program",
           "lower_training", "quiet_torchscript", "source_of"]
