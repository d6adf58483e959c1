"""`nimble.Nimble(module)`: nimble in-process, on a live module, with no artifact on disk.

    model = nimble.Nimble(net).prepare(torch.randn(32, 3, 32, 32, device="cuda"), training=True)
    loss = criterion(model(x), y)
    loss.backward()        # gradients land in net's own .grad tensors
    optimizer.step()       # any torch.optim optimizer over net.parameters()

`prepare` lowers the module through the same frontends and stream schedule as `nimble compile`.
For inference it exports the module with torch.export first and, where that or its lowering
fails, traces it to TorchScript instead; `Nimble.frontend` says which ("torch.export",
"torchscript (traced)", or "torchscript" for a TorchScript module, used as it is) and
`Nimble.fallback` why export was not used. It then plans the arena and loads the result as
`nimble.load` would.

A trace records one path through the forward, so it is never trusted in silence: the fallback
warns (NimbleWarning) with the reason, and the prepared model is checked against the module on
the example and on several random inputs (MismatchError where they differ). A forward that turns a
tensor into a Python value while it is traced (torch's TracerWarning: its control flow depends on
values) is refused, unless `strict=False`, which still warns and still checks.

Training always traces: it captures the forward and the backward as CUDA graphs bound to the
module's own tensors (see `training.py`).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import warnings

import torch

from . import frontend, guards, watch
from .errors import MismatchError, NimbleWarning, ShapeError, UnsupportedError, UsageError, first_line
from .frontend.quiet import buffers_kept, quiet_torch
from .ir import TensorSpec
from .specs import check_precision
from .ops import arguments, types

# what a call of another shape is told to do
PREPARED_FOR = "call prepare() with an example of this shape (a second Nimble can hold another shape)"


class Nimble:
    """A module run by nimble. Call `prepare(example_inputs, training=...)`, then call it like the
    module: `out = model(x)`: a tensor for one output, else a tuple. Outputs are fresh tensors, as
    the module's own would be; for inference `model(x, copy=False)` returns views of nimble's
    buffers instead, valid until the next call. `nimble.load(path)(x)` follows the same rules."""

    def __init__(self, module: torch.nn.Module):
        if not isinstance(module, torch.nn.Module):
            raise UsageError(f"Nimble wraps a torch.nn.Module or a TorchScript module, got a "
                             f"{type(module).__name__}")
        self.module = module
        self._runner = None
        self._compiled = None
        self._guard = None  # a guards.Watched or guards.EveryTensor once prepared
        self._training = False
        self._specs: list[TensorSpec] = []
        self._device = torch.device("cpu")
        self._streams: str | int = "auto"
        self.frontend: str | None = None  # "torch.export", "torchscript (traced)" or "torchscript"
        self.fallback: str | None = None  # why torch.export was not used, where it was tried

    def __repr__(self) -> str:
        name = type(self.module).__name__
        if self._runner is None:
            return f"<nimble.Nimble {name}: not prepared; call prepare(example_inputs)>"
        g = self._runner.graph
        mode = "training" if self._training else "inference"
        if self._training:
            runs = "forward and backward as CUDA graphs" if self._device.type == "cuda" else "serially"
        else:
            runs = self._runner.choice.describe() if self._device.type == "cuda" else "serially"
        return (f"<nimble.Nimble {name} for {mode} on {self._device}: ({g.describe(g.inputs)}) -> "
                f"({g.describe(g.outputs)}); through {self.frontend}, {len(g.ops)} ops on "
                f"{self._runner.schedule.num_streams} stream(s), runs {runs}; outputs are fresh tensors>")

    # ------------------------------------------------------------------------------ prepare
    def prepare(self, example_inputs, training: bool = False, streams: str | int = "auto",
                strict: bool = True, precision: str = "fp32", tolerance: float | None = None) -> Nimble:
        """Lower (torch.export first, else a trace; see `frontend`), schedule and capture the module
        for inputs shaped like `example_inputs` (a tensor, or a tuple or list of them).
        `training=True` prepares forward and backward (traced), and puts the module in training
        mode; `training=False` puts it in eval mode. `streams` is "auto" (one
        stream per chain of the schedule), 1, or a cap. `strict=False` accepts a trace whose
        forward converts tensors to Python values (with a warning; see the module docstring).
        `precision` "fp16" or "bf16" computes in that dtype (inference only; inputs and outputs
        keep the module's float32), each output held to a relative L2 error against float32
        (`tolerance`, which also makes the precision search keep the ops that need float32; see
        `nimble compile --precision`). Returns self."""
        from .pipeline import compile_training, parse_streams
        from .runtime.executable import Executable
        from .runtime.training import TrainingGraph

        xs = _as_inputs(example_inputs, "example_inputs")
        device = xs[0].device
        if any(x.device != device for x in xs):
            raise UsageError("example_inputs are on different devices; put them all on one device")
        home = _home_device(self.module)
        if home is not None and home != device:
            raise UsageError(f"the module is on {home} but example_inputs are on {device}; move both to one "
                             "device")
        self._streams = streams = parse_streams(streams)
        check_precision(precision, tolerance=tolerance)
        if training and precision != "fp32":
            raise UsageError("precision applies to inference; prepare(..., training=True) runs in the module's dtype")
        self._precision = (precision, tolerance)
        self._strict = bool(strict)
        self._runner = self._compiled = None
        self._specs = [TensorSpec(tuple(x.shape), types.dtype_name(x.dtype)) for x in xs]
        self._device, self._training = device, bool(training)
        self.module.train(self._training)
        if self._training:
            planned = compile_training(self._script(xs), self._specs, type(self.module).__name__, streams)
            self._runner = TrainingGraph(self.module, planned.graph, planned.constants, planned.schedule, device)
            self.frontend, self.fallback = self._script_kind(), None
        else:
            self._compiled, self.frontend, self.fallback = self._compile_inference(xs)
            self._runner = Executable(self._compiled.artifact(), device.type, shape_advice=PREPARED_FOR)
            if self.frontend == "torchscript (traced)":
                self._check_trace(xs)
        if self._guard is not None:
            self._guard.release()
        self._guard = guards.Watched(self.module) if not self._training and watch.watchable(self.module) else \
            guards.EveryTensor(self.module, versions=not self._training)
        return self

    def _compile_inference(self, xs: list[torch.Tensor]):
        """(compiled, frontend, fallback): the module compiled for inference through torch.export,
        or where that fails (fallback says why) through TorchScript."""
        from .errors import NimbleError
        from .pipeline import CompileOptions, compile_program, compile_script

        name = type(self.module).__name__
        options = CompileOptions(self._device.type, self._streams, check=False, precision=self._precision[0],
                                 tolerance=self._precision[1])
        fallback = None
        if not isinstance(self.module, torch.jit.ScriptModule):
            try:
                with warnings.catch_warnings(), torch.no_grad(), quiet_torch():
                    warnings.simplefilter("ignore")
                    program = torch.export.export(self.module, tuple(xs))
                return (compile_program(program, self._specs, name, f"{name} (in memory)", _program_digest(program),
                                        options), "torch.export", None)
            except MismatchError:  # the precision asked for does not hold: tracing would not change that
                raise
            except NimbleError as e:
                fallback = f"the exported program did not lower ({first_line(e)})"
            except Exception as e:  # data-dependent control flow, untraceable Python...
                fallback = f"torch.export failed ({first_line(e)})"
            warnings.warn(f"{name}: {fallback}; nimble traces it instead and checks the trace against the module "
                          f"on the example and {len(_VARIANTS)} other inputs", NimbleWarning, stacklevel=3)
        script = self._script(xs)
        compiled = compile_script(script, self._specs, name, f"{name} (in memory)", _digest(script), options)
        return compiled, self._script_kind(), fallback

    def _script_kind(self) -> str:
        return "torchscript" if isinstance(self.module, torch.jit.ScriptModule) else "torchscript (traced)"

    def _script(self, xs: list[torch.Tensor]) -> torch.jit.ScriptModule:
        """The module as TorchScript: itself, or traced on `xs` with its buffers and the RNG left as
        they were (tracing runs the forward once)."""
        if isinstance(self.module, torch.jit.ScriptModule):
            return self.module
        rng = [xs[0].device] if xs[0].device.type == "cuda" else []
        try:
            with frontend.quiet_torchscript(), warnings.catch_warnings(record=True) as caught, torch.no_grad(), \
                    torch.random.fork_rng(devices=rng), quiet_torch(), buffers_kept(self.module):
                warnings.simplefilter("always", torch.jit.TracerWarning)
                traced = torch.jit.trace(self.module, tuple(xs), check_trace=False)
        except Exception as e:
            raise UnsupportedError(f"{type(self.module).__name__} could not be traced ({first_line(e)}); "
                                   "pass a torch.jit.script of it instead") from e
        self._refuse_value_dependence(caught)
        return traced

    def _refuse_value_dependence(self, caught) -> None:
        """A trace that turned a tensor into a Python value fixed whatever that value decided
        (a branch, a size, a loop count): refused when strict, else a warning. Other warnings
        are passed on."""
        name = type(self.module).__name__
        for w in caught:
            if not issubclass(w.category, torch.jit.TracerWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        torch_dir = os.path.dirname(torch.__file__) + os.sep  # torch's own size checks (batch norm's) are static here
        found = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)
                 and "Converting a tensor to a Python" in str(w.message) and not str(w.filename).startswith(torch_dir)]
        if not found:
            return
        where = f"{found[0].filename}:{found[0].lineno}"
        what = str(found[0].message).split(" might")[0].lower()
        if self._strict:
            raise UnsupportedError(f"{name}: {what} at {where} while it was traced, so its control flow depends on "
                                   "tensor values and a trace would keep one path; make the forward exportable, pass "
                                   "a torch.jit.script of it, or prepare(..., strict=False) to accept a trace "
                                   "checked on random inputs")
        warnings.warn(f"{name}: {what} at {where}; the trace keeps one path (strict=False), checked against the module "
                      "on random inputs", NimbleWarning, stacklevel=5)

    def _check_trace(self, xs: list[torch.Tensor]) -> None:
        """Compare the prepared model with the module on the example and on _VARIANTS of it: a trace
        that kept one path of value-dependent control flow shows up as a mismatch."""
        from .runtime.base.compare import compare, default_tolerance

        rtol, atol = default_tolerance(self._device.type)
        l2 = self._compiled.precision["tolerance"] if self._compiled.precision else None
        gen = torch.Generator().manual_seed(0)
        for k, variant in enumerate((None, *_VARIANTS)):
            inputs = xs if variant is None else [_vary(x, variant, gen) for x in xs]
            with torch.no_grad():
                want = arguments.flatten_result(self.module(*inputs))
            got = self._runner.run(*inputs)
            result = compare(got, [w.detach() for w in want], rtol, atol, l2)
            if not result.passed:
                raise MismatchError(f"{type(self.module).__name__}: the traced model differs from the module on "
                                    f"{'the example' if variant is None else f'a {variant} input'} "
                                    f"({result.describe()}); its forward likely depends on tensor values. Make it "
                                    "exportable or pass a torch.jit.script of it")

    # ------------------------------------------------------------------------------ calls
    def __call__(self, *inputs: torch.Tensor, copy: bool = True):
        """Run the prepared model, as the module would: a tensor for one output, else a tuple.
        The outputs are fresh tensors; for inference, `copy=False` returns views of nimble's
        buffers instead (no copy), which the next call overwrites, as `nimble.load`'s do."""
        if self._runner is None:
            raise UsageError("call prepare(example_inputs) before running the model")
        if self.module.training != self._training:
            now, then = ("training", "inference") if self.module.training else ("eval", "training")
            raise UsageError(f"the module is in {now} mode but was prepared for {then}; call "
                             f"prepare(example_inputs, training={self.module.training}) again")
        xs = self._check_inputs(inputs) if self._training else self._check_placement(inputs)
        if self._training:  # the step writes the module's gradients: checked first
            self._guard.check()
            outs = self._runner(xs)
        else:  # the prepared copy runs on its own weights, so the module is checked once the run is
            outs = self._runner.run(*xs, copy=copy)  # issued: on CUDA the check overlaps the GPU's
            self._guard.check()  # work, and what a stale copy computed is never returned
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _check_placement(self, inputs) -> tuple:
        """What an inference call's `Executable` does not check (it checks the count, shapes, dtypes
        and index values, once, as it copies them in): each tensor's device, and no gradient."""
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor):
                self._check_one_placement(i, x)
        return inputs

    def _check_inputs(self, inputs) -> list[torch.Tensor]:
        """A training step's inputs, all checked here: its runner copies them in as they are."""
        if len(inputs) != len(self._specs):
            raise ShapeError(f"the model was prepared for {len(self._specs)} input(s), got {len(inputs)}")
        for i, (x, spec) in enumerate(zip(inputs, self._specs)):
            if not isinstance(x, torch.Tensor):
                raise ShapeError(f"input {i} must be a tensor, got {type(x).__name__}")
            if tuple(x.shape) != spec.shape or types.dtype_name(x.dtype) != spec.dtype:
                raise ShapeError(f"input {i} is {types.dtype_name(x.dtype)}{list(x.shape)} but the model "
                                 f"was prepared for {spec.dtype}{list(spec.shape)}; {PREPARED_FOR}")
            self._check_one_placement(i, x)
        return list(inputs)

    def _check_one_placement(self, i: int, x: torch.Tensor) -> None:
        if x.device != self._device:
            raise ShapeError(f"input {i} is on {x.device} but the model was prepared on {self._device}")
        if x.requires_grad:
            raise UsageError(f"input {i} requires grad; nimble computes gradients for the module's "
                             "parameters only. Pass x.detach(), or train without nimble")

    # ------------------------------------------------------------------------------ save
    def save(self, path: str | os.PathLike) -> None:
        """Write the `.nimble` artifact that `nimble compile` would write for the module as it is now
        (in eval mode) and the prepared input shapes."""
        from nimble.formats import write_artifact

        if self._runner is None:
            raise UsageError("call prepare(example_inputs) before save()")
        compiled = self._compiled
        if compiled is None or not self._guard.unchanged():
            self._guard.release()  # torch.export reads the module as it is, unwatched; the model stays stale
            was_training = self.module.training
            self.module.eval()
            try:
                xs = [torch.zeros(s.shape, dtype=types.DTYPES[s.dtype], device=self._device) for s in self._specs]
                compiled = self._compile_inference(xs)[0]
            finally:
                self.module.train(was_training)
        write_artifact(path, compiled.artifact())


_VARIANTS = ("negated", "random", "random", "random", "random")


def _vary(x: torch.Tensor, variant: str, gen: torch.Generator) -> torch.Tensor:
    """Another input like `x`: floats negated or drawn at `x`'s scale, integers (ids, say)
    shuffled among the example's own values, booleans drawn."""
    if x.dtype == torch.bool:
        return (torch.rand(x.shape, generator=gen) > 0.5).to(x.device)
    if not x.is_floating_point():
        flat = x.reshape(-1)
        return flat[torch.randint(0, max(flat.numel(), 1), (flat.numel(),), generator=gen).to(x.device)].view_as(x)
    if variant == "negated":
        return -x
    scale = float(x.detach().abs().max()) if x.numel() else 1.0
    return (torch.randn(x.shape, generator=gen) * max(scale, 1e-3)).to(x.device, x.dtype)


def _as_inputs(example, what: str) -> list[torch.Tensor]:
    xs = [example] if isinstance(example, torch.Tensor) else list(example) \
        if isinstance(example, (tuple, list)) else None
    if not xs or not all(isinstance(x, torch.Tensor) for x in xs):
        raise UsageError(f"{what} must be a tensor or a tuple of tensors, got {type(example).__name__}")
    for i, x in enumerate(xs):
        if x.requires_grad:
            raise UsageError(f"{what}[{i}] requires grad; nimble computes gradients for the module's "
                             "parameters only. Pass x.detach()")
    return xs


def _home_device(module: torch.nn.Module) -> torch.device | None:
    t = next(itertools.chain(module.parameters(), module.buffers()), None)
    return None if t is None else t.device


def _program_digest(program) -> str:
    """A hash of an exported program's graph and weights, for the manifest."""
    h = hashlib.sha256(str(program.graph).encode())
    for key, t in sorted({**program.state_dict, **program.constants}.items()):
        if isinstance(t, torch.Tensor):
            h.update(key.encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _digest(script: torch.jit.ScriptModule) -> str:
    buf = io.BytesIO()
    with frontend.quiet_torchscript():
        torch.jit.save(script, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()
