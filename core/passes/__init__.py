"""Graph -> Graph passes, one file each; `pipeline.py` lists the order in which they run.

A pass is a pure function over the IR: it takes a linted `Graph` and returns a linted `Graph`,
imports no runtime, and runs on a builder with no GPU. Fusion and precision passes go here.
"""

from .chain_loose_ops import chain_loose_ops
from .fuse_conv import fuse_conv
from .fuse_pointwise import fuse_pointwise

__all__ = ["chain_loose_ops", "fuse_conv", "fuse_pointwise"]
