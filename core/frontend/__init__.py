"""Frontends: a model file plus static input specs -> IR `Graph` and its weights.

`torchscript` loads a TorchScript archive and freezes its forward; `walker` walks its graph once, folding
host-side work (`hostops`) and typing every device op; `finalize` drops dead ops, adds ordering
edges for in-place writes and numbers the result densely. A frontend never imports the runtime.
"""

from .torchscript import Lowered, load_module, lower, lower_training, quiet_torchscript, source_of

__all__ = ["Lowered", "load_module", "lower", "lower_training", "quiet_torchscript", "source_of"]
