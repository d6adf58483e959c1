"""`nimble inspect`: what an artifact holds, without a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .common import (DebugOption, describe_batches, describe_precision, JsonOption, TuneOption, early_checks,
                     footprint_line, human_bytes, literal, print_json, user_errors, writable)
from .compile import describe_passes


def inspect_command(
    artifact: Path = typer.Argument(..., metavar="ARTIFACT", help="A .nimble artifact written by nimble compile."),
    json_out: JsonOption = False,
    dot: Optional[Path] = typer.Option(None, "--dot", help="Write a Graphviz picture of the schedule here."),
    ops: bool = typer.Option(True, "--ops/--no-ops", help="Show the per-op table."),
    device: Optional[str] = typer.Option(None, "--device", metavar="cuda|cpu|auto", help="Also load the artifact "
                                         "there and report what it holds on the device, by kind (weights, arena, "
                                         "inputs, results outside the arena, graph-pool workspaces, cuBLAS and "
                                         "cuDNN graph workspaces, cached). Without it nothing is loaded and no GPU "
                                         "is needed."),
    tune: TuneOption = "cached",
    debug: DebugOption = False,
) -> None:
    """Validate an artifact and show what it holds, on stdout; needs no GPU.

    Shows inputs, outputs, schedule, memory plan and one row per op (plain columns, nothing cut,
    when stdout is not a terminal, so grep and logs see every row); --json prints the plan
    document with the manifest.

    Example: nimble inspect sample_models/inception.nimble --json
    """
    with user_errors(debug, json_out):
        from nimble.model_files import check_artifact_file

        early_checks(device=device, tune=tune)
        check_artifact_file(artifact)
        from nimble.plan.document import plan_document
        from nimble.formats import read_artifact

        writable(dot, "--dot", {"the artifact": artifact})
        art = read_artifact(artifact)
        if dot is not None:
            from .compile import write_dot

            write_dot(dot, art.graph, art.schedule, art.model)
        footprint = _footprint(art, artifact, device, tune) if device is not None else None
        if json_out:
            man = art.manifest
            print_json(plan_document(art.graph, model=art.model, schedule=art.schedule, memory=art.memory,
                                     passes=art.passes, batches=art.batches) | {
                "manifest": {k: man.get(k) for k in ("format_version", "nimble_version", "torch_version", "model",
                                                     "source_sha256", "options")},
                "precision": art.precision,
                "input_names": [art.graph.values[i].name for i in art.graph.inputs],
                "output_names": [art.graph.values[o].name for o in art.graph.outputs],
                "footprint": footprint})
            return
        _summary(art, artifact, ops)
        if device is not None:
            print(footprint_line(footprint) if footprint else
                  "on the CPU, a loaded artifact holds its weights, arena and inputs as planned above")


def _footprint(art, path: Path, device: str, tune: str) -> dict | None:
    """Load `art` on `device` and return its GPU footprint as a document (None on the CPU)."""
    from nimble.runtime.opening import open_artifact

    with open_artifact(art, device, name=path.name, tune=tune) as exe:
        return exe.stats.footprint.document() if exe.stats.footprint else None


def _summary(art, path: Path, show_ops: bool) -> None:
    import sys

    from rich import box
    from rich.console import Console

    terminal = sys.stdout.isatty()
    # a terminal gets rich's tables at its width; a pipe or a log gets plain columns, never cut
    console = Console(highlight=False, width=None if terminal else 1_000_000, soft_wrap=not terminal)
    lines = box.SIMPLE_HEAD if terminal else None
    g, s, m, man = art.graph, art.schedule, art.memory, art.manifest
    table = Table(title=literal(path.name), title_justify="left", show_header=False, show_edge=False, box=lines)
    table.add_column(style="bold")
    table.add_column()
    for label, ids in (("input", g.inputs), ("output", g.outputs)):
        for i in ids:
            table.add_row(label, f"{literal(g.values[i].name)}: {g.values[i].spec.dtype}{list(g.values[i].spec.shape)}")
    weights = [g.values[w] for w in g.weights]
    table.add_row("model", f"{literal(man['model'])} (sha256 {literal(man['source_sha256'][:12])})")
    table.add_row("ops", str(len(g.ops)))
    table.add_row("precision", describe_precision(art.precision))
    if art.passes:
        table.add_row("passes", describe_passes(art.passes))
    table.add_row("streams", f"{s.num_streams} ({literal(s.requested)}), {s.num_waits} syncs, critical path {s.critical_path}"
                  + "".join(f"; a candidate on {len(set(cuda))} CUDA streams (at most {cap})" for cap, cuda in s.capped))
    table.add_row("arena", f"{human_bytes(m.arena_bytes)} ({m.lower_bound} lower bound {human_bytes(m.lower_bound_bytes)}, "
                           f"{m.arena_bytes / max(m.lower_bound_bytes, 1):.2f}x; without reuse "
                           f"{human_bytes(m.no_reuse_bytes)})")
    if art.batches:
        table.add_row("batch sizes", describe_batches({art.batch: (g, s, m), **art.batches})
                      + "; a call runs the smallest that holds its batch, padded (the rest of this table: "
                      f"batch {art.batch})")
    table.add_row("weights", f"{len(weights)} tensors, {human_bytes(sum(v.spec.nbytes for v in weights))}")
    table.add_row("versions", f"format {man['format_version']}, nimble {literal(man['nimble_version'])}, "
                              f"torch {literal(man['torch_version'])}")
    table.add_row("options", ", ".join(f"{literal(k)} {literal(v)}" for k, v in man["options"].items()))
    console.print(table)
    if not show_ops:
        return
    if art.precision and art.precision["fp32_ops"]:
        kept = Table(show_edge=False, pad_edge=False, title=f"ops computed in float32 in this {art.precision['dtype']} "
                     "artifact (rule: autocast's float32 list; kept: by the precision search)", title_justify="left",
                     box=lines)
        for col in ("value", "op", "why", "source"):
            kept.add_column(col, no_wrap=True)
        for o in art.precision["fp32_ops"]:
            kept.add_row(literal(o["op"]), literal(o["target"]), "rule" if o["why"] == "policy" else "kept",
                         literal(o["source"]))
        console.print(kept)
    ops = Table(show_edge=False, pad_edge=False, title="ops (offset: byte offset in the arena; "
                "'=vN': shares value N's storage)", title_justify="left", box=lines)
    for col in ("op", "target", "stream", "order", "waits", "output shape", "offset", "bytes"):
        ops.add_column(col, no_wrap=True, justify="right" if col in ("op", "stream", "order", "offset", "bytes")
                       else "left")
    for op in g.ops:
        outs = [g.values[o] for o in op.outputs]
        ops.add_row(str(op.id), literal(op.target.split("::")[1].split(".")[0]), str(s.stream[op.id]),
                    str(s.position[op.id]), ",".join(map(str, s.waits[op.id])),
                    " ".join("x".join(map(str, v.spec.shape)) + (f"=v{v.alias_of}" if v.alias_of is not None else "")
                             for v in outs),
                    " ".join(str(m.offset_of(g, v.id)) for v in outs),
                    human_bytes(sum(v.spec.nbytes for v in outs)))
    console.print(ops)
