"""Several artifacts loaded side by side in one process, run one at a time, holding one arena,
one set of CUDA streams and one set of workspaces between them.

A server that keeps many models on one GPU pays each load's arena, per-stream cuBLAS workspaces
(32 MiB a stream on Hopper) and cuDNN workspaces, though it runs one model at a time. A `Group`
pays them once: its members' activations live in one arena sized for the largest plan, their
ops run on one list of CUDA streams (with the cuBLAS workspaces PyTorch keeps per stream) and
take their cuDNN graphs' workspaces from one `cudnn_graph.Workspaces`, and their CUDA graphs
are captured into one graph pool (`torch.cuda.graph_pool_handle`), so the results outside the
arena and the temporaries of one member's replay reuse the memory of another's. Weights, input
buffers and CUDA graphs stay each member's own.

Sharing the arena and the pool is safe because the members' calls never overlap, and nothing in
either outlives a call but what a member's graph keeps allocated: each call (and each
`replay`) takes the group's lock, and on the GPU waits for the event the group's previous call
recorded, whichever member and whichever stream made it. The arena grows when a member with a
larger plan joins; every member already loaded is then captured again on the new arena (a
fraction of a second each; `load` with several paths sizes the arena for all of them first, so
that nothing is captured twice). A member's `copy=False` outputs are views into the arena:
valid until the next call of any member.

An artifact of several batch sizes cannot join a group: it already shares one arena between its
batch sizes (`batched.py`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import torch

from ..errors import ExecutionError, UsageError
from .kernels import cudnn_graph
from .base.device import resolve_device
from .executable import Executable


class Group:
    """Artifacts that share one arena, their CUDA streams and workspaces, and run one call at a
    time: `group.load(path)` gives an `Executable` called as any other. `close()` (or `with`)
    gives everything back."""

    def __init__(self, device: str = "auto"):
        self.device, self.notice = resolve_device(device)
        self.members: list[Executable] = []
        self.arena: torch.Tensor | None = None
        self._streams: list = []  # the CUDA streams, grown to the most any member uses
        self._blas_ready: set[int] = set()
        self._cudnn_workspaces = cudnn_graph.Workspaces()
        self._lock = threading.RLock()  # RLock: `verify` calls `run`
        cuda = self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if cuda else None  # the graph pool every member captures into
        self._done = torch.cuda.Event() if cuda else None  # waiting on it before its first record waits for nothing
        self._closed = False

    def load(self, *paths: str | Path, tune: str = "cached", verify: bool = False,
             max_memory: int | None = None) -> Executable | list[Executable]:
        """Read and load each artifact into the group (`nimble.load`'s arguments, per member); one
        path gives its executable, several a list. All are read before any is loaded, so the
        arena is sized once for the largest plan among them and the members loaded before. Where
        one fails to load, those this call loaded before it are closed again."""
        from nimble.formats import read_artifact

        self._ensure_open()
        if not paths:
            raise UsageError("Group.load needs at least one artifact path")
        read = []
        for path in paths:
            t = time.perf_counter()
            read.append((Path(path).name, read_artifact(path), time.perf_counter() - t))
        for name, art, _ in read:
            if art.batches:
                raise UsageError(f"{name} holds several batch sizes, which share an arena of their own; load it "
                                 "alone with nimble.load, or compile one batch size for the group")
        with self._lock:
            if self.device.type == "cuda":  # no member's call still runs on the arena the new ones warm up on
                torch.cuda.synchronize(self.device)
            self.reserve(max(art.memory.arena_bytes for _, art, _ in read))
            loaded = []
            try:
                for name, art, read_s in read:
                    exe = Executable(art, self.device.type, name=name, tune=tune, max_memory=max_memory, group=self)
                    exe.stats.seconds = {"read": read_s, **exe.stats.seconds,
                                         "total": read_s + exe.stats.seconds["total"]}
                    loaded.append(exe)
                    if verify:
                        exe.verify()
            except BaseException:  # all of this call's members or none: the ones loaded go again
                for exe in loaded:
                    exe.close()
                raise
        return loaded[0] if len(loaded) == 1 else loaded

    # ------------------------------------------------------------------------------ the arena
    def reserve(self, nbytes: int) -> torch.Tensor:
        """The group's arena, grown to at least `nbytes`; on growth every member moves onto the
        new one (captured again on CUDA) and the old one goes."""
        with self._lock:
            if self.arena is not None and self.arena.numel() >= nbytes:
                return self.arena
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            try:
                grown = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError):
                raise ExecutionError(f"out of memory on {self.device} while growing the group's arena to "
                                     f"{nbytes / 2**20:.1f} MiB; close members or free memory first") from None
            old, moved = self.arena, []
            try:
                for exe in self.members:
                    exe._rebase(grown)
                    moved.append(exe)
            except BaseException:
                for exe in moved:  # back onto the arena they ran on, which still holds their plan
                    exe._rebase(old)
                raise
            self.arena = grown
            del old
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return self.arena

    # ------------------------------------------------------------------------------ members
    def _join(self, exe: Executable) -> None:
        self.members.append(exe)

    def _leave(self, exe: Executable) -> None:
        """A member closed; the last one to go gives back the arena, streams and workspaces."""
        with self._lock:
            if exe in self.members:
                self.members.remove(exe)
            if not self.members:
                self.arena = None
                self._streams, self._blas_ready = [], set()
                self._cudnn_workspaces = cudnn_graph.Workspaces()

    @contextlib.contextmanager
    def turn(self):
        """One call of a member: alone on the host, and after the previous call on the GPU."""
        with self._lock:
            if self._done is not None:
                torch.cuda.current_stream(self.device).wait_event(self._done)
            yield
            if self._done is not None:
                self._done.record(torch.cuda.current_stream(self.device))

    def _ensure_open(self) -> None:
        if self._closed:
            raise UsageError("the group was closed; make a new nimble.Group to load artifacts again")

    def close(self) -> None:
        """Close every member; the group takes no more loads."""
        with self._lock:
            for exe in list(self.members):
                exe.close()
            self._closed = True

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        arena = 0 if self.arena is None else self.arena.numel()
        return (f"<nimble.Group on {self.device}: {len(self.members)} member(s), one arena of "
                f"{arena / 2**20:.1f} MiB, {len(self._streams)} CUDA stream(s)>")
