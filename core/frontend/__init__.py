"""Frontends: a model file plus static input specs -> IR `Graph` and its weights.

`torchscript` loads a TorchScript archive and freezes its forward; `export` loads a torch.export
`.pt2` program; `walker` walks a TorchScript graph once (and lowers every frontend's device ops), folding
host-side work (`hostops`) and typing every device op; `finalize` drops dead ops, adds ordering
edges for in-place writes and numbers the result densely. A frontend never imports the runtime.
"""

from . import export
from .export import is_program, load_program, lower_program
from .torchscript import Lowered, load_module, lower, lower_training, quiet_torchscript, source_of

__all__ = ["Lowered", "export", "is_program", "load_module", "load_program", "lower", "lower_program",
           "lower_training", "quiet_torchscript", "source_of"]
