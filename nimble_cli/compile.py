"""`nimble compile`: TorchScript model or torch.export program -> the .nimble artifact."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .common import (describe_batches, describe_precision, progress, DebugOption, DeviceOption, JsonOption, console,
                     early_checks, human_bytes, literal, print_json, user_errors, writable)


def compile_command(
    model: Path = typer.Argument(..., metavar="MODEL", help="TorchScript model saved with torch.jit.save (.pt), "
                                 "or a program saved with torch.export.save (.pt2)."),
    shape: Optional[list[str]] = typer.Option(None, "--shape", "-s", metavar="SHAPE",
                                              help="Static shape of an input, e.g. 1x3x224x224. Repeat "
                                              "once per model input, in order. Required for TorchScript; "
                                              "a .pt2 program brings its own shapes."),
    dtype: Optional[list[str]] = typer.Option(None, "--dtype", metavar="DTYPE",
                                              help="Input dtype (default float32; a .pt2 program's own). "
                                              "Give one for all inputs or one per --shape."),
    streams: str = typer.Option("auto", "--streams", help="auto: one stream per chain of Nimble's schedule "
                                "(maximum concurrency, minimum syncs), up to 64, else the widest level's op count; "
                                "1: a single stream; N: at most N streams. Where the streams need more than 2 CUDA "
                                "streams, the artifact also stores them folded onto 2, which loading times "
                                "as a candidate."),
    device: DeviceOption = "auto",
    dot: Optional[Path] = typer.Option(None, "--dot", help="Write a Graphviz picture of the schedule here: ops "
                                       "coloured by stream, waits dashed."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Where to write the artifact (a file, or "
                                          "a folder for MODEL-NAME.nimble). Default: next to the model."),
    fuse: bool = typer.Option(True, "--fuse/--no-fuse", help="Fuse each convolution with its bias, residual add "
                              "and relu, and chains of elementwise ops, into fused ops that load as cuDNN fused "
                              "convolutions and generated kernels on CUDA. --no-fuse keeps one aten op per op."),
    precision: str = typer.Option("fp32", "--precision", metavar="fp32|fp16|bf16",
                                  help="Compute in float16 or bfloat16, with weights stored so (half the bytes). "
                                  "Softmax, the norms, exp, log, pow and large reductions stay float32, as "
                                  "under autocast. The check then holds each output to a relative L2 error "
                                  "against the float32 model (default 1e-2 for fp16, 5e-2 for bf16)."),
    io_dtype: str = typer.Option("model", "--io-dtype", metavar="model|reduced",
                                 help="With --precision fp16/bf16: inputs and outputs keep the model's float32, "
                                 "cast inside the graph (model), or take the reduced dtype (reduced)."),
    tolerance: Optional[float] = typer.Option(None, "--tolerance", metavar="L2",
                                              help="With --precision fp16/bf16: search for the fewest ops to keep "
                                              "in float32 so that every output is within this relative L2 error "
                                              "of float32 on the sample input, e.g. 1e-2. Without it, a compile "
                                              "whose outputs are further off names the op that first loses "
                                              "accuracy."),
    input_names: Optional[str] = typer.Option(None, "--input-names", metavar="N1,N2,...",
                                              help="What clients call the inputs, in order (default: the "
                                              "model's argument names)."),
    output_names: Optional[str] = typer.Option(None, "--output-names", metavar="N1,N2,...",
                                               help="What clients call the outputs, in order (default: the "
                                               "model's own: a returned dict's keys, else output or output_0, "
                                               "output_1...)."),
    batch_sizes: Optional[str] = typer.Option(None, "--batch-sizes", metavar="B1,B2,...",
                                              help="Compile one graph, schedule and memory plan for each batch "
                                              "size, as the first dimension of every input, into one artifact "
                                              "with one copy of the weights, e.g. --batch-sizes 1,2,4,8,16. A "
                                              "call then runs the smallest that holds its batch, padded (what "
                                              "`nimble serve` batches requests into). The model must compute "
                                              "each row of the batch from that row alone; compile checks it."),
    gpu_arch: Optional[str] = typer.Option(None, "--gpu-arch", metavar="sm_90,sm_80,...",
                                           help="Also build the artifact's generated kernels for these GPU "
                                           "architectures, here, with no GPU (needs Triton: pip install "
                                           "'nimble[pack]'), into a kernel pack beside it, MODEL.nimble.kernels "
                                           "(one per architecture: .kernels.sm_80 ...). A load that is given "
                                           "the pack (run --kernels) starts without building them."),
    sign_with: Optional[Path] = typer.Option(None, "--sign-with", metavar="KEY",
                                             help="Sign the kernel pack with this key file (16 bytes or more, "
                                             "kept secret): a machine whose NIMBLE_KERNEL_KEY names the same "
                                             "key uses the pack beside the artifact without --kernels."),
    json_out: JsonOption = False,
    debug: DebugOption = False,
) -> None:
    """Compile a TorchScript model or a torch.export program into a .nimble artifact.

    The artifact holds the op graph, the multi-stream schedule, the memory plan, the weights, and a
    reference input and output. Compiling needs no GPU.

    Examples: nimble compile sample_models/inception.pt --shape 1x3x224x224;
    nimble compile model.pt2 (its shapes come from the program's example inputs);
    nimble compile model.pt --shape 8x3x224x224 --precision fp16 --tolerance 1e-2;
    nimble compile model.pt --shape 1x3x224x224 --batch-sizes 1,2,4,8,16;
    nimble compile model.pt --shape 1x3x224x224 --gpu-arch sm_90 (kernels built ahead of time).
    """
    with user_errors(debug, json_out):
        from nimble.specs import input_specs

        specs = input_specs(shape, dtype) if shape else None  # the pipeline asks for them where needed
        if dtype and not shape:
            from nimble.errors import UsageError

            raise UsageError("--dtype goes with --shape; a .pt2 program brings its own input dtypes")
        from nimble.model_files import check_model_file

        early_checks(device=device, streams=streams)
        from nimble.specs import check_precision

        check_precision(precision, io_dtype, tolerance)
        from nimble.specs import parse_batch_sizes

        batches = parse_batch_sizes(batch_sizes)
        from nimble.specs import parse_names

        names = parse_names(input_names, "--input-names"), parse_names(output_names, "--output-names")
        targets, key = _pack_options(gpu_arch, sign_with)
        check_model_file(model)  # an artifact, an ONNX file or a folder: said before anything else
        target = artifact_path(model, output)
        writable(target, "-o" if output is not None else "the default output", {"the model": model})
        writable(dot, "--dot", {"the model": model, "the artifact": target})
        from nimble.pipeline import compile_model

        with progress(f"{model.name}: compiling") as update:
            compiled = compile_model(model, specs, device=device, streams=streams,
                                     progress=lambda stage: update(f"{model.name}: {stage}"), fuse=fuse,
                                     precision=precision, io_dtype=io_dtype, tolerance=tolerance,
                                     batch_sizes=batches, input_names=names[0], output_names=names[1])
            update(f"{model.name}: writing {target.name}")
            t = time.perf_counter()
            size, interrupted = _write(target, compiled.artifact())
            compiled.seconds["write"] = time.perf_counter() - t
            if targets and not interrupted:
                compiled.packs = _build_packs(compiled, target, targets, key, update)
        try:  # the artifact is complete: an interrupt from here on keeps it
            if not interrupted:
                _report(compiled, target, size, dot, model.name, json_out)
                return
        except KeyboardInterrupt:
            pass
        console.print(f"interrupted after {literal(target)} was written ({human_bytes(size)}); it is complete "
                      "and valid, and kept")


def _pack_options(gpu_arch: str | None, sign_with: Path | None):
    """--gpu-arch's targets and --sign-with's key, refused in one line before compiling."""
    from nimble.errors import UsageError

    if gpu_arch is None:
        if sign_with is not None:
            raise UsageError("--sign-with signs a kernel pack: give --gpu-arch too")
        return [], None
    import importlib.util

    from nimble.runtime.kernels import aot
    from nimble.runtime.kernels import pack as packs

    targets = aot.targets(gpu_arch)
    if importlib.util.find_spec("triton") is None:
        raise UsageError("--gpu-arch builds kernels with Triton, which is not installed: pip install 'nimble[pack]' "
                         "(or triton), or leave out --gpu-arch")
    try:
        key = packs.read_key(str(sign_with)) if sign_with is not None else None
    except packs.PackMiss as e:
        raise UsageError(f"--sign-with: {e}") from None
    return targets, key


def _build_packs(compiled, target: Path, targets, key, update) -> list[dict]:
    """Build the kernel packs beside `target`; what `--json` and the summary say of them."""
    from nimble.runtime import prebuild

    from nimble.errors import ExecutionError, first_line

    t = time.perf_counter()
    try:
        made = prebuild.ahead(compiled.artifact(), targets, Path(f"{target}.kernels"), key,
                              say=lambda line: update(f"{target.name}: {line}"))
    except Exception as e:  # the artifact stands on its own: say so, and that loads build the kernels
        raise ExecutionError(f"{target.name} is written and complete, but its kernel pack could not be built "
                             f"({type(e).__name__}: {first_line(e)}); loads build its kernels from source") from None
    seconds = time.perf_counter() - t
    compiled.seconds["kernels"] = seconds
    return [{"path": str(path), "arch": t_.name, "kernels": n, "bytes": path.stat().st_size, "signed": key is not None,
             "seconds": round(seconds / len(made), 3), "failed": failed} for t_, path, n, failed in made]


def _report(compiled, target: Path, size: int, dot: Path | None, name: str, json_out: bool) -> None:
    """What compile says once the artifact is written: the picture, the JSON document, the summary."""
    if dot is not None:
        write_dot(dot, compiled.graph, compiled.schedule, name)
    if json_out:
        print_json(compile_document(compiled, target, size))
    _summary(compiled)
    console.print(f"  wrote {literal(target)} ({human_bytes(size)})")
    for p in getattr(compiled, "packs", []):
        console.print(f"  wrote {literal(Path(p['path']))} ({p['kernels']} kernels for {p['arch']}, "
                      f"{human_bytes(p['bytes'])}{', signed' if p['signed'] else ''}; "
                      f"{len(p['failed'])} did not build, they build at load)" if p["failed"] else
                      f"  wrote {literal(Path(p['path']))} ({p['kernels']} kernels for {p['arch']}, "
                      f"{human_bytes(p['bytes'])}{', signed' if p['signed'] else ''})")
    if dot is not None:
        console.print(f"  wrote {dot} (render with: dot -Tsvg {dot} -o schedule.svg)")


def _write(target: Path, art) -> tuple[int, bool]:
    """Write the artifact: (its bytes, whether an interrupt came). An interrupt that lands once the
    artifact is in place (renamed over the target, the last step) keeps it, after reading it back
    whole; one that lands before leaves nothing, as always."""
    from nimble.formats import read_artifact, write_artifact

    def identity():
        try:
            st = os.stat(target)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    before = identity()
    try:
        return write_artifact(target, art), False
    except KeyboardInterrupt:
        if identity() in (None, before):
            raise
        try:
            read_artifact(target)
        except Exception:
            raise KeyboardInterrupt from None
        return target.stat().st_size, True


def compile_document(compiled, target: Path, size: int) -> dict:
    """`compile --json`: the plan document, and beside it the artifact written (path, bytes,
    sha256), the check against the model, each stage's seconds and the versions."""
    import torch

    from nimble import __version__
    from nimble.fileio import sha256_file
    from nimble.formats.spec import FORMAT_VERSION, ONE_BATCH_VERSION
    from nimble.plan.document import plan_document

    c = compiled.check
    others = {b: (c.graph, c.schedule, c.memory) for b, c in zip(compiled.batch_sizes[1:], compiled.others)}
    return plan_document(compiled.graph, model=compiled.model, schedule=compiled.schedule, memory=compiled.memory,
                         passes=compiled.passes, batches=others) | {
        "artifact": {"path": str(target), "bytes": size, "sha256": sha256_file(target)},
        "check": None if c is None else {"device": compiled.check_device} | c.document(),
        "precision": compiled.precision,
        "stages_seconds": {k: round(v, 4) for k, v in compiled.seconds.items()},
        "versions": {"nimble": __version__, "torch": torch.__version__, "format": FORMAT_VERSION if others else ONE_BATCH_VERSION},
    } | ({"kernel_packs": compiled.packs} if getattr(compiled, "packs", None) else {})


def artifact_path(model: Path, output: Path | None) -> Path:
    """Where compile writes: -o as given (a folder gets <stem>.nimble), else next to the model."""
    from nimble.errors import UsageError

    if output is None:
        return model.with_suffix(".nimble")
    if output.is_dir():
        return output / f"{model.stem}.nimble"
    if not output.parent.is_dir():
        raise UsageError(f"-o {output}: folder {output.parent} does not exist")
    return output


def describe_passes(passes) -> str:
    """'lowered 71 ops, fuse_conv 71 -> 60, fuse_pointwise 60 -> 42; 25 more passes changed no op
    count': the passes that changed the count of ops, in order (`--json` lists every pass)."""
    if not passes:
        return "none"
    (first, n), rest = passes[0], passes[1:]
    changed, before = [], n
    for name, count in rest:
        if count != before:
            changed.append(f"{literal(name)} {before} -> {count}")
        before = count
    unchanged = len(rest) - len(changed)
    more = f"{'; ' if changed else ', '}{unchanged} {'more ' if changed else ''}pass{'es' if unchanged != 1 else ''} " \
        f"changed no op count" if unchanged else ""
    return ", ".join([f"{literal(first)} {n} ops", *changed]) + more


def describe_seconds(seconds: dict[str, float]) -> str:
    """'load 0.06 s, lower 0.07 s, check 0.06 s, write 0.01 s; 27 stages under 0.005 s': the
    stages that took 5 ms or more, in order (`--json` times every stage)."""
    shown = [f"{literal(k)} {v:.2f} s" for k, v in seconds.items() if v >= 0.005]
    quick = len(seconds) - len(shown)
    return ", ".join(shown) + (f"{'; ' if shown else ''}{quick} stage{'s' if quick != 1 else ''} under 0.005 s"
                               if quick else "")


def write_dot(path: Path, graph, schedule, title: str) -> None:
    from nimble.plan.dot import to_dot
    from nimble.fileio import write_atomic

    write_atomic(path, to_dot(graph, schedule, title).encode())


def _summary(c) -> None:
    g = c.graph
    vals = g.values
    weights = [v for v in vals if v.kind == "weight"]
    acts = [v for v in vals if v.kind == "activation"]
    own = [v for v in acts if v.alias_of is None]
    fused = sum(1 for op in g.ops if op.target == "nimble::fused")
    console.print(f"[bold]{literal(c.name)}[/]: {len(g.ops)} ops, {len(g.inputs)} input(s), {len(g.outputs)} output(s)")
    if fused:
        console.print(f"  fusion: {c.lowered_ops} lowered ops became {len(g.ops)}, {fused} of them fused")
    console.print(f"  passes: {describe_passes(c.passes)}")
    for label, ids in (("input", g.inputs), ("output", g.outputs)):
        for i in ids:
            console.print(f"  {label} {literal(vals[i].name)}: {vals[i].spec.dtype}{list(vals[i].spec.shape)}")
    console.print(f"  weights: {len(weights)} tensors, {human_bytes(sum(v.spec.nbytes for v in weights))}")
    console.print(f"  activations: {len(own)} buffers, {human_bytes(sum(v.spec.nbytes for v in own))} "
                  f"without reuse ({len(acts) - len(own)} views)")
    kinds: dict[str, int] = {}
    for op in g.ops:
        kinds[op.target] = kinds.get(op.target, 0) + 1
    top = ", ".join(f"{k.split('::')[1]} {n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:6])
    console.print(f"  ops by kind: {top}{', ...' if len(kinds) > 6 else ''}")
    s = c.schedule
    console.print(f"  schedule ({s.requested}): {s.num_streams} streams, {s.num_waits} waits; "
                  f"{s.reduction_edges} reduction edges, critical path {s.critical_path} ops, "
                  f"widest level {s.max_width} ops"
                  + "".join(f"; stored beside it, a candidate on at most {cap} CUDA streams" for cap, _ in s.capped))
    m = c.memory
    console.print(f"  memory: arena {human_bytes(m.arena_bytes)}, {m.lower_bound} lower bound {human_bytes(m.lower_bound_bytes)} "
                  f"({m.arena_bytes / max(m.lower_bound_bytes, 1):.2f}x), without reuse {human_bytes(m.no_reuse_bytes)}")
    table = Table(title="largest activations", title_justify="left", show_edge=False, pad_edge=False)
    for col in ("value", "op", "shape", "dtype", "bytes"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for v in sorted(own, key=lambda v: (-v.spec.nbytes, v.id))[:5]:
        table.add_row(literal(v.name), literal(g.ops[v.producer].target), "x".join(map(str, v.spec.shape)), v.spec.dtype,
                      human_bytes(v.spec.nbytes))
    console.print(table)
    if c.others:
        plans = {b: (o.graph, o.schedule, o.memory) for b, o in zip(c.batch_sizes, [c, *c.others])}
        console.print(f"  batch sizes: {describe_batches(plans)}; one copy of the weights (the lines above: "
                      f"batch {c.batch_sizes[0]})")
    if c.precision is not None:
        console.print(f"  precision: {describe_precision(c.precision)}")
    if c.check is not None:
        console.print(f"  check on {c.check_device}: {c.check.describe()}")
    total = sum(c.seconds.values())
    console.print(f"  time: {describe_seconds(c.seconds)}; total {total:.2f} s, "
                  f"{total - c.seconds.get('check', 0):.2f} s without the reference run")
