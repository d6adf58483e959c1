"""The one place that states the order of nimble's stages (DESIGN.md, "Data flow").

    frontend (model -> Graph) -> REWRITES, LAYOUT, FUSION (Graph -> Graph) -> check against the model
        -> schedule (Graph -> Schedule) -> memory (Graph, Schedule -> MemoryPlan) -> Compiled

`compile_model` reads a file, `compile_script` and `compile_program` take a module or a program in
memory, and `compile_training` is the training-mode order that `nimble.Nimble(...).prepare(training=True)`
runs. `run_stages` runs the stages after loading, each through one instrument (`stages.Stages`):
it times each once, and lints the graph after every pass. Options travel as one `CompileOptions`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import dtypes, frontend, multibatch, passes
from .errors import ExecutionError, MismatchError, UnsupportedError, UsageError, first_line, is_out_of_memory
from .fileio import sha256_file
from .ir import WEIGHT, Graph, TensorSpec
from .specs import NEED_SHAPES, PRECISIONS, check_precision, parse_streams
from .ops import arguments, types
from .runtime.base.device import resolve_device
from .plan import capped
from .plan.memory import MemoryPlan, plan
from .plan.schedule import Schedule, assign_streams
from .plan.verify import check_plan
from .runtime.placed import reference
from .runtime.placed.reference import one_thread
from .passes.reduce_precision import Precision
from .runtime.base.compare import L2_TOLERANCE, Comparison, compare, default_tolerance
from .stages import Stages, cycles_uncollected

# Graph -> Graph passes, in the order they run (each is one file under passes/). The frontends emit
# what the model says; every rewrite is here. Functionalisation runs first, as TorchScript's
# remove_mutation does, so that common subexpressions and fusion see pure ops. The op order is made
# canonical before anything that decides by order (fusion, the schedule) or names by it.
REWRITES: tuple = (passes.functionalise, passes.fold_constants, passes.index_as_view, passes.normalise_convolutions,
                   passes.fold_batch_norm, passes.affine_batch_norm, passes.flatten_concats,
                   passes.merge_sibling_convolutions,
                   passes.match_multi_head_attention, passes.match_attention, passes.precompute_attention_masks,
                   passes.inline_scalar_constants, passes.drop_identity_copies, passes.bias_into_epilogue,
                   passes.eliminate_common_subexpressions,
                   passes.eliminate_dead_ops, passes.order_canonically, passes.name_values)
# After the precision is chosen (each weight then has the dtype it is stored in) and before fusion:
# which dtype and layout the kernels read what the rewrites left in.
LAYOUT: tuple = (passes.drop_precision_casts, passes.align_attention_masks)
FUSION: tuple = (passes.bias_into_broadcast, passes.fuse_conv, passes.fuse_pointwise, passes.generate_broadcast_ops,
                 passes.fuse_lone_convolutions, passes.fuse_concats)
PASSES: tuple = REWRITES + LAYOUT + FUSION
TRAINING_PASSES: tuple = (passes.name_values, passes.eliminate_dead_ops, passes.chain_loose_ops)


@dataclass
class Compiled:
    """Everything `nimble compile` produces for one model and one set of input specs."""

    name: str
    model: str  # the source file's name
    source_sha256: str
    graph: Graph
    weights: dict[str, torch.Tensor]
    sample_inputs: list[torch.Tensor]
    sample_outputs: list[torch.Tensor]  # the TorchScript module's outputs for sample_inputs
    check: Comparison | None
    check_device: str
    schedule: Schedule
    memory: MemoryPlan
    options: dict
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> seconds, each counted once
    passes: list[tuple[str, int]] = field(default_factory=list)  # ("lowered", ops), then (pass, ops after it)
    precision: dict | None = None  # reduced precision: dtype, io, tolerance, the float32 ops and why
    others: list[Compiled] = field(default_factory=list)  # --batch-sizes: the compilations of the larger ones

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes compiled, smallest first ([] when compiled for one)."""
        return [c.graph.values[c.graph.inputs[0]].spec.shape[0] for c in [self, *self.others]] if self.others else []

    @property
    def lowered_ops(self) -> int:
        """Ops before the passes ran."""
        return self.passes[0][1] if self.passes else len(self.graph.ops)

    def artifact(self):
        """The `.nimble` artifact of this compilation (nimble.formats.Artifact)."""
        from nimble.formats import Artifact

        manifest = {"model": self.model, "source_sha256": self.source_sha256, "options": self.options,
                    "passes": [[name, n] for name, n in self.passes]}
        if self.precision is not None:
            manifest["precision"] = self.precision
        return Artifact(manifest, self.graph, self.schedule, self.memory, self.weights,
                        self.sample_inputs, self.sample_outputs,
                        {b: (c.graph, c.schedule, c.memory) for b, c in zip(self.batch_sizes[1:], self.others)})


@dataclass(frozen=True)
class CompileOptions:
    """How to compile, as `nimble compile`'s options say: where the check runs (`device`), the
    stream cap (`streams`: "auto", 1 or a cap), whether to check the op list against the model,
    whether to run the FUSION passes (the REWRITES and LAYOUT passes always run, `fold_constants`
    where asked), and the precision."""

    device: str = "auto"
    streams: str | int = "auto"
    check: bool = True
    fuse: bool = True
    precision: str = "fp32"  # fp32, fp16 or bf16 (passes/reduce_precision.py)
    io_dtype: str = "model"  # reduced precision: inputs and outputs keep float32 ("model") or not ("reduced")
    tolerance: float | None = None  # reduced precision: search for the float32 ops this relative L2 error needs
    fold_constants: bool = True  # off for a multi-batch artifact: its batch sizes share one set of weights
    batch: int | None = None  # a multi-batch artifact's member: its batch size
    batch_rows: frozenset[str] = frozenset()  # its weights made one row expanded to it (`passes.batch_constants`)
    input_names: tuple[str, ...] | None = None  # what clients call the inputs (--input-names); None: the model's
    output_names: tuple[str, ...] | None = None  # and the outputs (--output-names); None: the model's (`name_io`)

    def __post_init__(self):
        check_precision(self.precision, self.io_dtype, self.tolerance)


@dataclass(frozen=True)
class Source:
    """What a compiled model is called and where it came from, for the manifest."""

    name: str  # the artifact's default file name
    model: str  # the source file's name
    digest: str  # its sha256
    frontend: str  # "torchscript" or "torch.export"


def sample_inputs(specs: list[TensorSpec], seed: int = 0) -> list[torch.Tensor]:
    """Deterministic random inputs: normal floats (and complex numbers), small non-negative ints,
    random bools."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for spec in specs:
        dtype = types.DTYPES[spec.dtype]
        if dtype.is_floating_point:
            out.append(torch.randn(spec.shape, generator=gen).to(dtype))
        elif dtype.is_complex:
            out.append(torch.randn(spec.shape, generator=gen, dtype=dtype))
        elif dtype == torch.bool:
            out.append(torch.rand(spec.shape, generator=gen) > 0.5)
        else:
            out.append(torch.randint(0, 2, spec.shape, generator=gen, dtype=dtype))
    return out


@cycles_uncollected
def compile_model(path: str | Path, inputs: list[TensorSpec] | None, device: str = "auto",
                  streams: str | int = "auto", check: bool = True, progress: Callable[[str], None] = lambda stage: None,
                  fuse: bool = True, precision: str = "fp32", io_dtype: str = "model",
                  tolerance: float | None = None, batch_sizes: list[int] | None = None,
                  input_names: tuple[str, ...] | None = None, output_names: tuple[str, ...] | None = None) -> Compiled:
    """Load a TorchScript model or a torch.export `.pt2` program, lower it for `inputs` (None: a
    program's own input specs), check the op list against the model, and schedule it on
    `streams` ("auto", 1, or a cap). `batch_sizes` compiles it once for each, as the first
    dimension of every input (`compile_batches`).

    `input_names` and `output_names` are what clients call them (default: the model's own names).
    `progress(stage)` is called as each stage starts. `fuse` runs the FUSION passes; without it
    every op stays a single aten op. The check runs the op list on `device`
    and compares it with the model run on the CPU; a mismatch raises MismatchError.
    `precision`, `io_dtype` and `tolerance` as `CompileOptions` says.
    """
    path = Path(path)
    options = CompileOptions(device, streams, check, fuse, precision, io_dtype, tolerance,
                             input_names=input_names, output_names=output_names)
    stages = Stages(progress)
    with stages.stage("load", "loading"):
        names = frontend.check_model_file(path)
        program = frontend.is_program(path, names)
        module = frontend.load_program(path) if program else frontend.load_module(path, names)
        digest = sha256_file(path)
    if inputs is None and not program:
        raise UsageError(NEED_SHAPES)
    compile_one = compile_program if program else compile_script
    if batch_sizes:
        if inputs is None:  # a program's own input specs, its batch dimension set per batch size below
            inputs = [TensorSpec(tuple(1 if d is None and k == 0 else d for k, d in enumerate(shape)),
                                 types.dtype_name(dtype)) for _, shape, dtype in frontend.export.program_inputs(module)]
        # a folded value may be shaped by the batch (positions expanded to it): the batch sizes share weights
        shared = dataclasses.replace(options, fold_constants=False)
        return multibatch.compile_batches(lambda specs, samples, st, batch_rows: compile_one(
                                   module, specs, path.stem, path.name, digest,
                                   dataclasses.replace(shared, batch=specs[0].shape[0], batch_rows=batch_rows),
                                   st, samples),
                               inputs, batch_sizes, path.name, stages,
                               frontend.export.reference_of(module) if program else module)
    return compile_one(module, inputs, path.stem, path.name, digest, options, stages)


def compile_program(program, inputs: list[TensorSpec] | None, name: str, model: str, digest: str,
                    options: CompileOptions = CompileOptions(), stages: Stages | None = None,
                    samples: list[torch.Tensor] | None = None) -> Compiled:
    """`compile_script` for a torch.export ExportedProgram. `inputs` may be None: the program's
    own input shapes, which must then be static."""
    _check_weight_dtypes({**program.state_dict, **program.constants}, model)
    specs = frontend.export.input_specs_for(program, inputs, model)
    return run_stages(lambda: frontend.lower_program(program, specs, model), specs,
                      Source(name, model, digest, "torch.export"), options, stages, samples,
                      frontend.export.output_names(program))


def compile_script(module: torch.jit.ScriptModule, inputs: list[TensorSpec], name: str, model: str,
                   digest: str, options: CompileOptions = CompileOptions(), stages: Stages | None = None,
                   samples: list[torch.Tensor] | None = None) -> Compiled:
    """`compile_model` for a module already in memory. `model` and `digest` name its source in
    the manifest. Its weights may live on any device; the check runs on `options.device`.
    `samples`: the sample inputs to check and store (default: `sample_inputs(inputs)`)."""
    _check_weight_dtypes(module.state_dict(), model)
    return run_stages(lambda: frontend.lower(module, inputs, model), inputs,
                      Source(name, model, digest, "torchscript"), options, stages, samples)


def _check_weight_dtypes(state: dict, model: str) -> None:
    """Before any work: the artifact must be able to hold every weight."""
    for key, tensor in state.items():
        if isinstance(tensor, torch.Tensor) and tensor.dtype not in types.DTYPE_NAMES:
            name = str(tensor.dtype).removeprefix("torch.")
            raise UnsupportedError(f"{model}: weight '{key}': {dtypes.refusal(name)}")


def run_stages(lower, inputs: list[TensorSpec], source: Source, options: CompileOptions,
               stages: Stages | None = None, samples: list[torch.Tensor] | None = None,
               model_outputs: list[str] | None = None) -> Compiled:
    """The stages after loading, shared by both frontends, in order: the frontend (`lower()`), the
    PASSES, the names clients see (`model_outputs`: the model's own; None: `output`, or `output_k`
    for several), the check against the model, the schedule and the memory plan."""
    stages = stages or Stages()
    device = resolve_device(options.device)[0].type
    streams = parse_streams(options.streams)
    with stages.stage("lower", "lowering"):
        lowered = lower()
    if options.batch_rows:  # the batch sizes share weights: a batch-shaped constant is one row expanded
        graph, weights = passes.batch_constants(lowered.graph, lowered.weights, options.batch, options.batch_rows)
        lowered = dataclasses.replace(lowered, graph=graph, weights=weights)
    order = REWRITES if options.fold_constants else tuple(p for p in REWRITES if p is not passes.fold_constants)
    lowered = rewrite(lowered, order, stages)
    lowered = dataclasses.replace(lowered, graph=_named(lowered.graph, options, model_outputs, source.model))
    record = None
    if options.precision != "fp32":  # the search converts the graph; its last conversion is the pass's result
        with stages.stage("precision", f"choosing the {options.precision} ops"):
            converted, record = _choose_precision(lowered, inputs, source.model, options, device, stages)
        stages.passed("reduce_precision", converted.graph)
        lowered = dataclasses.replace(lowered, graph=converted.graph, weights=converted.weights)
    lowered = rewrite(lowered, LAYOUT, stages, label=None)
    if options.fuse:
        lowered = rewrite(lowered, FUSION, stages, label=None)
    with stages.stage("check", "running the reference"):
        xs, expected, result = _reference_check(lowered, inputs, source.model, device, options.check,
                                                record["tolerance"] if record else None, samples)
    with stages.stage("schedule", "scheduling"):  # the planned streams and the capped candidates
        schedule = capped.with_candidates(assign_streams(lowered.graph, streams))
    with stages.stage("memory", "planning memory"):  # one plan, proved safe under every candidate
        memory = plan(lowered.graph, schedule)
        check_plan(lowered.graph, schedule, memory)
    manifest_options = {"streams": str(streams), "shapes": ["x".join(map(str, s.shape)) or "scalar" for s in inputs],
                        "dtypes": [s.dtype for s in inputs], "fuse": options.fuse, "frontend": source.frontend}
    weights = {k: t.cpu() for k, t in lowered.weights.items()}  # the artifact's copy; a no-op on the CPU
    graph = lowered.graph
    expected = _as_dtypes(graph, graph.outputs, [e.detach() for e in expected])
    return Compiled(source.name, source.model, source.digest, graph, weights, _as_dtypes(graph, graph.inputs, xs),
                    [e.contiguous() for e in expected], result, device, schedule, memory, manifest_options,
                    dict(stages.seconds), list(stages.passes), record)


def _named(graph: Graph, options: CompileOptions, model_outputs: list[str] | None, model: str) -> Graph:
    """The graph with the input and output names clients see: those asked for, else the model's."""
    for option, given, ids in (("--input-names", options.input_names, graph.inputs),
                               ("--output-names", options.output_names, graph.outputs)):
        if given is not None and len(given) != len(ids):
            now = ", ".join(graph.values[i].name for i in ids)
            raise UsageError(f"{option} gives {len(given)} name(s) but {model} has {len(ids)} "
                             f"{option[2:].split('-')[0]}(s) ({now}); give one name for each")
    outputs = list(options.output_names) if options.output_names is not None else model_outputs
    if outputs is None or len(outputs) != len(graph.outputs):
        outputs = ["output"] if len(graph.outputs) == 1 else [f"output_{k}" for k in range(len(graph.outputs))]
    named, problems = passes.name_io(graph, options.input_names and list(options.input_names), outputs)
    chosen = [line for side, line in problems
              if (options.input_names if side == "inputs" else options.output_names) is not None]
    if chosen:
        raise UsageError(f"{model}: {chosen[0]}; choose other names")
    return named


def _as_dtypes(graph: Graph, ids, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` in the dtypes of the graph values `ids` (a reduced-precision graph's inputs or
    outputs may be float16 where the model's are float32)."""
    return [t.to(types.DTYPES[graph.values[i].spec.dtype]) for t, i in zip(tensors, ids)]


def _choose_precision(lowered, inputs: list[TensorSpec], model: str, options: CompileOptions, device: str,
                      stages: Stages):
    """The graph converted by `reduce_precision` (keeping in float32 the ops a --tolerance needs,
    found by `precision.search` on the sample inputs) and the record the manifest keeps of it."""
    from .precision import search

    dtype = PRECISIONS[options.precision]
    limit = options.tolerance if options.tolerance is not None else L2_TOLERANCE[dtype]
    xs = sample_inputs(inputs)

    def run(graph, weights):
        with torch.no_grad(), one_thread():
            return reference.run_values(graph, weights, _as_dtypes(graph, graph.inputs, xs), device)

    try:
        found = search(lowered.graph, lowered.weights, Precision(dtype, options.io_dtype), run, options.tolerance,
                       limit, stages.progress)
    except ValueError as e:
        raise MismatchError(f"{model}: at {options.precision}, {e}; raise --tolerance") from None
    graph = lowered.graph
    kept = [{"op": graph.values[graph.ops[i].outputs[0]].name if graph.ops[i].outputs else f"op {i}",
             "target": graph.ops[i].target, "source": graph.ops[i].source, "why": why}
            for i, why in sorted(found.converted.fp32.items())]
    floating = sum(1 for op in graph.ops if any(graph.values[o].spec.dtype == "float32" for o in op.outputs))
    record = {"dtype": dtype, "io": options.io_dtype, "tolerance": limit, "searched": options.tolerance is not None,
              "fp32_ops": kept, "floating_ops": floating, "errors": found.errors, "tries": found.tries}
    if found.loss is not None:
        raise MismatchError(f"{model}: at {options.precision} the outputs are {max(found.errors):.3g} off float32 "
                            "(relative L2; "
                            f"tolerance {limit:g}); the first op to lose accuracy is {found.loss}"
                            + ("; or give --tolerance 1e-2 to keep the ops that need it in float32"
                               if options.tolerance is None else "; or raise --tolerance"))
    return found.converted, record


def _reference_check(lowered, inputs: list[TensorSpec], model: str, device: str, check: bool,
                     l2: float | None = None, samples: list[torch.Tensor] | None = None):
    """(sample inputs, the model's outputs for them, the op list's comparison or None). `l2`: a
    reduced-precision graph, held to that relative L2 error per output against the model.
    `samples`: the sample inputs (default: `sample_inputs(inputs)`)."""
    try:
        xs = sample_inputs(inputs) if samples is None else samples
        home = next(iter(lowered.weights.values())).device if lowered.weights else torch.device("cpu")
        # one thread: the stored outputs are the same at any thread count; no graph-executor
        # optimization: on a first run it costs time that grows faster than the op count
        with frontend.quiet_torchscript(), torch.no_grad(), one_thread(), torch.jit.optimized_execution(False):
            expected = [e.cpu() for e in arguments.flatten_result(lowered.module(*[x.to(home) for x in xs]))]
        given = _as_dtypes(lowered.graph, lowered.graph.inputs, xs)
        got = reference.run(lowered.graph, lowered.weights, given, device) if check else None
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        raise ExecutionError(f"{model}: ran out of {'GPU ' if device == 'cuda' else ''}memory running the model on "
                             f"its sample input ({first_line(e)}); use a smaller batch in --shape"
                             + ("" if device == "cpu" else ", or --device cpu")) from None
    if not check:
        return xs, expected, None
    rtol, atol = default_tolerance(device)
    result = compare(got, expected, rtol, atol, l2)
    if not result.passed:
        raise MismatchError(f"{model}: the lowered op list does not reproduce the model on "
                            f"{device}: {result.describe()}")
    return xs, expected, result


@dataclass(frozen=True)
class TrainingPlan:
    graph: Graph  # the training-mode op list; weights are named by the module's qualified names
    constants: dict[str, torch.Tensor]  # weights that are not the module's own parameters or buffers
    schedule: Schedule


def compile_training(module: torch.jit.ScriptModule, inputs: list[TensorSpec], name: str,
                     streams: str | int = "auto") -> TrainingPlan:
    """The training-mode pipeline: lower unfrozen, run TRAINING_PASSES, schedule. There is no
    arena plan: autograd keeps saved activations alive until the backward."""
    lowered = rewrite(frontend.lower_training(module, inputs, name), TRAINING_PASSES)
    return TrainingPlan(lowered.graph, lowered.weights, assign_streams(lowered.graph, parse_streams(streams)))


def rewrite(lowered: frontend.Lowered, order: tuple = REWRITES, stages: Stages | None = None,
            label: str | None = "lowered") -> frontend.Lowered:
    """`lowered` after the passes in `order` (by default the REWRITES: a frontend's graph as fusion
    takes it), with only the weights its graph still reads. `label` names the graph before them
    in the list of passes (None: it continues an earlier call)."""
    graph, weights = (stages or Stages()).run_passes(lowered.graph, lowered.weights, order, passes.REWRITES_WEIGHTS,
                                                     label)
    kept = {v.name: weights[v.name] for v in graph.values if v.kind == WEIGHT}  # in the order the graph reads them
    return dataclasses.replace(lowered, graph=graph, weights=kept)
