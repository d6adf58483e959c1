"""Running an IR graph on a device: `executable` (load an artifact, capture it into a CUDA graph
on the planned streams and arena, replay it), `group` (artifacts that share one arena, streams
and workspaces, and run one at a time), `streams` (issuing an op list on planned streams,
and capture), `placement` (ops writing into their arena views), `training` (captured forward and
backward on a live module), `reference` (the serial executor every result is checked against),
`trace` (the timeline `bench --trace` writes), `compare` (output comparison) and `timing`
(benchmark timers)."""

from .executable import Executable
from .opening import load
from .group import Group

__all__ = ["Executable", "Group", "load"]
