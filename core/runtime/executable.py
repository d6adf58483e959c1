"""Loading an artifact for execution: `nimble.load(path) -> Executable`.

Loading first runs the preflight (`preflight.py`): every op on the meta device, checked against its
declared spec and buffer, before any data moves. On CUDA, it then moves the weights to the device,
allocates one arena of the planned size and one static buffer per input, creates the planned
streams, runs the op list once eagerly on those streams (which validates every op and creates each
stream's cuBLAS and cuDNN handles and workspaces; the streams fork from the current stream, as in
capture, so they follow the weight and input copies), then captures it once into a CUDA graph in
issue order: each op on its stream, an event wait for each planned wait, every side stream forked
from the capturing stream and joined back to it. A call copies the inputs into their buffers and
replays the graph. Loading reads the schedule and the memory plan from the artifact; it never
computes them. What it does choose is how they run on this GPU (`tune/`): the layout, the
planned streams (or at most two, or one), cuDNN's convolution algorithms and its fused
convolutions, by building and timing a few candidates, or by reading the choice from the tuning
cache. Fused ops run as cuDNN fused convolutions or generated kernels (`kernels/fused.py`).

The planned streams are folded onto as few CUDA streams as keep them all parallel
(`plan/capped.fold`), made once per load; a capped candidate is the one the artifact stores
(`capped.streams_under`). During the warm-up and the capture, a result outside the
arena is dropped once its last reader is issued, so the graph pool reuses its memory. What the
load holds on the GPU is reported by kind (`footprint.py`), and `close()` gives it back.

On the CPU, the same placed op list runs serially in issue order on each call.

The runtime's floors, each importing only from those below it: `base/` (device, streams, timing,
caches, settings), `kernels/` (the kernel library), `placed/` (one op into its planned buffer),
`pairs/` (load-time pairs of ops), `assemble/` (buffers, issue order, a candidate's kernels,
capture), `tune/` (the candidates and their search), then this call path, `batched.py`,
`group.py` and `opening.py` (`load`).
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import MismatchError
from .base.compare import compare, default_tolerance, l2_tolerance
from .loading import Loading
from .assemble import inputs as inputs_mod


class Executable(Loading):
    """A loaded artifact. Calling it runs one inference, as the module would: `y = exe(x)` gives a
    tensor when the model has one output and a tuple when it has several; `exe.run(x)` always
    gives a list.

    The rule on aliasing is `nimble.Nimble`'s: outputs are fresh tensors of your own. With
    `copy=False` they are views of nimble's buffers instead (no copy, for the lowest latency),
    which the next call overwrites."""

    # ------------------------------------------------------------------------------ calls
    def __call__(self, *inputs: torch.Tensor, copy: bool = True) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """One inference: a tensor for a model with one output, else a tuple (fresh tensors; views
        of nimble's buffers until the next call with `copy=False`)."""
        outs = self.run(*inputs, copy=copy)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def run(self, *inputs: torch.Tensor, copy: bool = True) -> list[torch.Tensor]:
        """One inference, its outputs always as a list (for code that handles any number of
        outputs); `copy` as for a call."""
        self._ensure_open()
        with self._turn():
            self._load_inputs(inputs)
            outputs = self._compute()
            return [t.clone() for t in outputs] if copy else outputs

    def run_rows(self, blocks: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """One inference on inputs given as blocks of rows that already passed `check_inputs` (a
        server's requests, each checked once as it arrived): each block's tensors are copied
        straight into the input buffers at its rows, the rows after the last block zeroed, with no
        check again and no concatenation. The outputs are views of nimble's buffers (`copy=False`)
        until the next call. The inputs' first dimension is the batch; on an artifact of one
        input shape the blocks' rows must add up to it or less."""
        self._ensure_open()
        with self._turn():
            inputs_mod.copy_rows(self._inputs, blocks)
            return self._compute()

    def _compute(self) -> list[torch.Tensor]:
        """One inference on what the input buffers hold: the captured graph replayed (its outputs,
        views of nimble's buffers), else the placed ops issued serially."""
        if self._cuda_graph is not None:
            self._cuda_graph.replay()
            return list(self._outputs)
        env = self._issue(validate=True)
        return [env[o] for o in self.graph.outputs]

    def _turn(self):
        """The group's turn (its lock, and the GPU after its last call), else nothing."""
        return self._group.turn() if self._group is not None else contextlib.nullcontext()

    def __repr__(self) -> str:
        g = self.graph
        runs = self.choice.describe() if self.device.type == "cuda" else "the placed op list, serially"
        return (f"<nimble.Executable {self.artifact.model} on {self.device}: ({g.describe(g.inputs)}) -> "
                f"({g.describe(g.outputs)}); {len(g.ops)} ops on {self.schedule.num_streams} stream(s), runs as "
                f"{runs}; outputs are fresh tensors (copy=False: views of its buffers until the next call)>")

    def replay(self) -> None:
        """One inference on whatever the input buffers hold (for benchmarks)."""
        self._ensure_open()
        with self._turn():
            self._compute()

    def _load_inputs(self, inputs) -> None:
        inputs_mod.copy_in(self.graph, self._inputs, self._indices, inputs, self.shape_advice)

    def check_inputs(self, inputs) -> None:
        """Raise ShapeError, in one line, unless `inputs` are what a call takes: their count,
        shapes and dtypes, and index values inside their tables (`assemble/inputs.py`)."""
        inputs_mod.check_inputs(self.graph, self._inputs, self._indices, inputs, self.shape_advice)

    def check_values(self, inputs) -> None:
        """Raise ShapeError unless every index input's values lie inside the table it indexes (on
        CUDA, one outside would trip a device-side assert and end the process)."""
        inputs_mod.check_values(self.graph, self._indices, inputs)

    def verify(self, rtol: float | None = None, atol: float | None = None):
        """Run the stored sample input and compare with the stored sample outputs (the load-time
        self-check `nimble.load(..., verify=True)` asks for). Returns the comparison."""
        rt, at = default_tolerance(self.device.type)
        result = compare(self.run(*self.artifact.sample_inputs), self.artifact.sample_outputs,
                         rt if rtol is None else rtol, at if atol is None else atol, l2_tolerance(self.artifact, rtol))
        if not result.passed:
            raise MismatchError(f"{self.artifact.model}: on the stored sample input the loaded artifact does not "
                                f"reproduce the stored outputs: {result.describe()}")
        return result

    @property
    def input_buffers(self) -> list[torch.Tensor]:
        """The static input buffers; what is written here directly is not range-checked, so write
        only values that passed a call (the stored sample inputs do)."""
        return list(self._inputs)

    def outside_arena(self) -> list[int]:
        """Planned values that the captured graph holds elsewhere than at their planned offset, or
        held there and released after their last reader: the results of fused ops that a cuDNN
        fused kernel computes (it allocates its own result)."""
        if self._cuda_graph is None or not self._with_arena:
            return []
        base, held = self.arena.data_ptr(), self._tensors
        return [vid for vid in sorted(self._views)  # a value the capture released is not held any more
                if vid not in held or held[vid].data_ptr() - base != self.memory.offset[vid]]

    def tensors(self) -> dict[int, torch.Tensor]:
        """Value id -> the tensor holding it in the captured graph (CUDA) or after the last call;
        on CUDA, not the results outside the arena released after their last reader, and under a
        choice with depthwise prologues a depthwise convolution's input holds its producer's
        convolution alone (the depthwise kernel applies the rest), and where a 1x1 convolution
        computes the elementwise op before it as it loads (`pairs.input_pairs`), that op's buffer
        holds nothing."""
        return dict(self._tensors if self._cuda_graph is not None else getattr(self, "_env_after", {}))
