"""`nimble bench`: latency, throughput and memory of an artifact, beside PyTorch baselines."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .common import (check_pack, describe_kernels, describe_precision, progress, DebugOption, DeviceOption, JsonOption, KernelsOption, MaxMemoryOption, TuneOption,
                     console, early_checks, footprint_line, human_bytes, literal, print_json, user_errors, writable)

BENCH_SCHEMA_VERSION = 2
VARIANTS = {
    "nimble": "planned streams, planned arena, one CUDA graph",
    "eager": "the same op list run eagerly, one op at a time, no graph",
    "pytorch_graph_1stream": "one-stream CUDA graph of the op list in PyTorch's graph pool",
    "pytorch_graph_streams": "the planned multi-stream CUDA graph in PyTorch's graph pool",
}
SHORT = {"nimble": "nimble", "eager": "eager", "pytorch_graph_1stream": "pt graph 1s",
         "pytorch_graph_streams": "pt graph ms"}


def bench_command(
    artifact: Path = typer.Argument(..., metavar="ARTIFACT", help="A .nimble artifact written by nimble compile."),
    warmup_ms: float = typer.Option(200, "--warmup", "--warmup-ms", metavar="MS",
                                    help="Warm-up time before measuring, per variant, in ms (trtexec's --warmUp)."),
    duration_s: float = typer.Option(3.0, "--duration", "--duration-s", metavar="S",
                                     help="Measure for about S seconds in all: nimble half of it, the baselines "
                                     "the other half, each batch size of a sweep a share; the timing ends within "
                                     "2 x S, however slow the machine. 0 leaves --iterations alone to decide."),
    iterations: int = typer.Option(10, "--iterations", "-n", help="Measure at least N inferences per variant "
                                   "(trtexec's --iterations) where --duration allows it; with --duration 0, "
                                   "exactly N."),
    percentiles: str = typer.Option("90,95,99", "--percentiles", help="Latency percentiles to report."),
    baselines: bool = typer.Option(True, "--baselines/--no-baselines", help="Also time the eager op list and "
                                   "PyTorch-pool CUDA graphs in the same process."),
    inputs: Optional[list[str]] = typer.Option(None, "--input", "-i", help="Time on these inputs instead of the "
                                               "artifact's stored sample: NAME=FILE.npy or NAME=FILE.safetensors (or "
                                               "just FILE for a one-input model), as for nimble run."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "-b", metavar="N",
                                             help="For an artifact of several batch sizes (compile --batch-sizes): "
                                             "the one to time in full (default: the largest). Every batch size's "
                                             "throughput is reported besides."),
    device: DeviceOption = "auto",
    tune: TuneOption = "cached",
    kernels: KernelsOption = None,
    max_memory: MaxMemoryOption = None,
    json_out: JsonOption = False,
    export_times: Optional[Path] = typer.Option(None, "--export-times", help="Write nimble's per-inference "
                                                "times (latency, GPU, enqueue; ms) to this JSON file."),
    trace: Optional[Path] = typer.Option(None, "--trace", metavar="FILE", help="Write a Chrome/Perfetto trace "
                                         "(JSON; open in ui.perfetto.dev): each op on its stream, one track per "
                                         "stream, with GPU times, and a few CUDA graph replays."),
    debug: DebugOption = False,
) -> None:
    """Measure latency, throughput, load time and memory, beside PyTorch baselines.

    Latency is reported in trtexec's terms (min, mean, median, percentiles, max, GPU compute time,
    host enqueue time, throughput, coefficient of variation), with load time, time to first
    inference and GPU memory. Three baselines run in the same process: the eager op list, and
    one-stream and multi-stream CUDA graphs in PyTorch's graph pool.

    Example: nimble bench sample_models/inception.nimble --duration 2
    """
    with user_errors(debug, json_out):
        import time

        from nimble.model_files import check_artifact_file

        budget = early_checks(device=device, tune=tune, max_memory=max_memory)
        check_pack(kernels)
        check_artifact_file(artifact)
        import torch

        from nimble.errors import UsageError
        from nimble.runtime.baselines import baselines as build_baselines
        from nimble.runtime.opening import load
        from nimble.runtime.base.timing import measure

        try:
            pcts = tuple(float(p) for p in percentiles.split(",") if p.strip())
        except ValueError:
            raise UsageError(f"--percentiles {percentiles!r}: give numbers such as 90,95,99") from None
        if not all(0 < p <= 100 for p in pcts):
            raise UsageError("--percentiles must lie in (0, 100]")
        given = {"the artifact": artifact, "an --input file": [i.partition("=")[2] or i for i in inputs or []]}
        writable(export_times, "--export-times", given)
        writable(trace, "--trace", {**given, "--export-times": export_times})
        from .run import read_inputs

        if iterations < 1:
            raise UsageError("--iterations must be at least 1")
        if duration_s < 0 or warmup_ms < 0:
            raise UsageError("--duration and --warmup must not be negative")

        with progress(f"loading {artifact.name}") as update:
            from nimble.runtime.base.streams import count_kernels

            t0 = time.perf_counter()
            with _graph_dump(torch.cuda.is_available() and device != "cpu") as dump:
                loaded = load(artifact, device, tune=tune, max_memory=budget, graph_dump=dump, kernels=kernels)
                kernels = count_kernels(dump) if dump and loaded.device.type == "cuda" else None
            exe, sizes = _one_batch(loaded, batch_size, artifact.name)
            if exe is not loaded and exe is not loaded.executable(sizes[-1]):
                kernels = None  # the count is the largest batch size's graph
            cuda = exe.device.type == "cuda"
            xs = read_inputs(inputs, exe.graph) if inputs else exe.artifact.sample_inputs
            exe(*[x.to(exe.device) for x in xs], copy=False)  # checked (shapes, dtypes, index ranges) into the input buffers
            if cuda:
                torch.cuda.synchronize()
            first = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated() if cuda else None
            if exe.notice:
                console.print(f"[yellow]note:[/] {exe.notice}")
            traced = None
            if trace is not None:
                update("tracing")
                traced = _write_trace(exe, trace)
            runners = {"nimble": exe.replay}
            stats = loaded.stats
            memory = {"weights_bytes": stats.weight_bytes, "arena_bytes": stats.arena_bytes,
                      "scratch_bytes": stats.scratch_bytes, "process_peak_bytes": peak,
                      "footprint": stats.footprint.document() if stats.footprint else None}
            if baselines:
                update("building baselines")
                for name, baseline in build_baselines(exe, xs).items():
                    runners[name] = baseline.replay
                    if baseline.pool_bytes is not None:
                        memory[f"{name}_pool_bytes"] = baseline.pool_bytes
            results = {}
            swept = sizes if len(sizes) > 1 else []
            shares = time_shares(duration_s, list(runners), len(swept))
            for name, replay in runners.items():
                update(f"timing {name}")
                results[name] = measure(replay, cuda=cuda, warmup_ms=warmup_ms, duration_s=shares[name],
                                        iterations=iterations,
                                        until=time.perf_counter() + 2 * shares[name] if duration_s else None)
            per_batch = []
            for b in swept:
                update(f"timing batch {b}")
                timed = measure(loaded.executable(b).replay, cuda=cuda, warmup_ms=min(warmup_ms, 50),
                                duration_s=shares["batch"], iterations=iterations,
                                until=time.perf_counter() + 2 * shares["batch"] if duration_s else None
                                ).summary(pcts)
                per_batch.append({"batch": b, "median_ms": timed["median_ms"],
                                  "inferences_per_s": timed["throughput_per_s"],
                                  "rows_per_s": timed["throughput_per_s"] * b})
        summaries = {k: t.summary(pcts) for k, t in results.items()}
        why = {k: unsteady(summaries["nimble"], s) for k, s in summaries.items() if k != "nimble"}
        withheld = {k: w for k, w in why.items() if w}
        report = {
            "schema_version": BENCH_SCHEMA_VERSION, "artifact": str(artifact), "device": str(exe.device),
            "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
            "load_seconds": stats.seconds["total"], "first_inference_seconds": first,
            "load_breakdown_seconds": stats.seconds, "memory": memory,
            "tuning": {"choice": stats.choice or None, "how": stats.tuning or None,
                       "candidates_gpu_ms": stats.tuning_ms,
                       "candidates_pool_bytes": stats.tuning_pool_bytes,
                       "candidates_seconds": stats.tuning_seconds},
            "kernels": {"per_inference": kernels, "generated": stats.kernels_generated,
                        "source_cache_hits": stats.kernel_source_hits,
                        "binaries_recalled": stats.kernel_binaries_recalled,
                        "interpreted_fused_ops": stats.kernel_fallbacks,
                        "before_load": None if stats.prebuilt is None else stats.prebuilt.document()},
            "batch": exe.artifact.batch, "batch_sizes": per_batch,
            "inputs": "given" if inputs else "stored sample",
            "precision": exe.artifact.precision,
            "trace": traced,
            "settings": {"warmup_ms": warmup_ms, "duration_s": duration_s,
                         "iterations": iterations, "percentiles": list(pcts)},
            "results": summaries,
            "speedup_vs": {k: s["mean_ms"] / summaries["nimble"]["mean_ms"] for k, s in summaries.items()
                           if k != "nimble" and k not in withheld},
            "speedup_withheld": withheld,
        }
        if export_times is not None:
            from nimble.fileio import write_atomic

            t = results["nimble"]
            write_atomic(export_times, json.dumps([{"latency_ms": a, "gpu_ms": b, "enqueue_ms": c} for a, b, c in
                                                   zip(t.latency_ms, t.gpu_ms or [None] * len(t.latency_ms),
                                                       t.enqueue_ms)], indent=1).encode())
        if json_out:
            print_json(report)
        _print(report, pcts)


@contextlib.contextmanager
def _graph_dump(cuda: bool):
    """Where the load writes its captured graph's DOT file, which counts the kernels per
    inference: a file in a temporary folder, removed after. None on the CPU, or where no temporary
    folder can be made (`TMPDIR` unwritable): the count is then left out (null), not the bench."""
    if not cuda:
        yield None
        return
    import tempfile

    try:
        folder = tempfile.TemporaryDirectory()
    except OSError:
        yield None
        return
    with folder:
        yield str(Path(folder.name) / "graph.dot")


def _one_batch(loaded, batch: int | None, name: str):
    """(the executable to time, every batch size the artifact holds): the one compiled for
    `batch`, or the largest; an artifact of one batch size is its own."""
    from nimble.errors import UsageError

    sizes = getattr(loaded, "batch_sizes", None)
    if sizes:
        return loaded.executable(sizes[-1] if batch is None else batch), sizes
    own = loaded.artifact.batch
    if batch is not None and batch != own:
        raise UsageError(f"--batch-size {batch}: {name} was compiled for batch {own} alone; compile it with "
                         "--batch-sizes to hold several")
    return loaded, [] if own is None else [own]


def _write_trace(exe, path: Path) -> dict:
    """Write `exe`'s trace (`runtime/trace.py`) to `path`; what the report says of it."""
    from nimble.fileio import write_atomic
    from nimble.runtime.trace import chrome_trace

    doc = chrome_trace(exe)
    write_atomic(path, json.dumps(doc).encode())
    other = doc["otherData"]
    replays = sorted(other["replay ms"])
    return {"path": str(path), "events": len(doc["traceEvents"]),
            "streams": len({e["tid"] for e in doc["traceEvents"] if e.get("cat") == "op"}),
            "op_list_ms": other["op list ms"], "replay_median_ms": replays[len(replays) // 2] if replays else None}


CV_LIMIT = 2.5  # percent: over it, a timed run is too unsteady to compare


def unsteady(nimble: dict, other: dict) -> str | None:
    """Why a speedup of nimble over `other` would not be backed by the numbers, or None."""
    worst = max(nimble["cv_percent"], other["cv_percent"])
    if worst <= CV_LIMIT:
        return None
    return (f"the coefficient of variation is {worst:.1f}%, over {CV_LIMIT}%, so a ratio of means says little; rerun "
            "on an idle machine, or with a longer --duration")


def time_shares(duration_s: float, variants: list[str], batches: int) -> dict[str, float]:
    """Each timed run's share of --duration: nimble half (all of it where it runs alone), the
    baselines the other half between them, and each batch size of the sweep an eighth of
    --duration between them, taken from both. Each run ends within twice its share, so the timing
    ends within twice --duration."""
    sweep = duration_s / 8 if batches else 0.0
    rest = duration_s - sweep
    others = [v for v in variants if v != "nimble"]
    shares = {"nimble": rest / 2 if others else rest, **{v: rest / 2 / len(others) for v in others}}
    shares["batch"] = sweep / batches if batches else 0.0
    return shares


def _print(r: dict, pcts) -> None:
    console.print(f"[bold]{literal(Path(r['artifact']).name)}[/] on {r['gpu'] or r['device']} (torch {r['torch']}): "
                  f"loaded in {r['load_seconds']:.2f} s, first inference after {r['first_inference_seconds']:.2f} s")
    load = ", ".join(f"{k} {v:.2f}" for k, v in r["load_breakdown_seconds"].items() if k != "total")
    console.print(f"  load breakdown, s: {load}")
    if describe_kernels(r["kernels"]["before_load"]):
        console.print(f"  {describe_kernels(r['kernels']['before_load'])}")
    console.print(f"  precision: {describe_precision(r['precision'])}")
    if r["batch_sizes"]:
        console.print(f"  batch sizes: timed in full at {r['batch']}; each one's median per inference: " + ", ".join(
            f"{b['batch']}: {b['median_ms']:.3f} ms, {b['rows_per_s']:.0f} rows/s" for b in r["batch_sizes"]))
    t, k = r["tuning"], r["kernels"]
    if t["choice"]:
        console.print(f"  runs as: {t['choice']} ({t['how']})")
    if k["per_inference"] is not None:
        console.print(f"  kernels per inference: {k['per_inference']}; fused kernels generated {k['generated']} "
                      f"({k['source_cache_hits']} from the cache folder; {k['binaries_recalled']} launched from an "
                      "earlier process's binary, without Triton)"
                      + (f", {len(k['interpreted_fused_ops'])} fused ops interpreted" if k["interpreted_fused_ops"]
                         else ""))
    names = list(r["results"])
    counts = {r["results"][n]["iterations"] for n in names}
    table = Table(show_edge=False, pad_edge=False, title_justify="left",
                  title=f"latency per inference, ms, over {'/'.join(map(str, sorted(counts)))} timed inferences")
    table.add_column("")
    for name in names:
        table.add_column(SHORT[name], justify="right", no_wrap=True)
    rows = [("mean", "mean_ms"), ("median", "median_ms"), *[(f"p{p:g}", f"p{p:g}_ms") for p in pcts],
            ("min", "min_ms"), ("max", "max_ms"), ("GPU compute", "gpu_mean_ms"), ("host enqueue", "enqueue_mean_ms")]
    for label, key in rows:
        table.add_row(label, *("-" if r["results"][n][key] is None else f"{r['results'][n][key]:.3f}" for n in names))
    table.add_row("inferences timed", *(str(r["results"][n]["iterations"]) for n in names))
    table.add_row("throughput /s (timed run)", *(f"{r['results'][n]['throughput_per_s']:.0f}" for n in names))
    table.add_row("back to back /s (no sync)", *(f"{r['results'][n]['back_to_back_per_s']:.0f}" for n in names))
    table.add_row("CV %", *(f"{r['results'][n]['cv_percent']:.1f}" for n in names))
    if len(names) > 1:
        table.add_row("nimble speedup", *(f"{r['speedup_vs'][n]:.2f}x" if n in r["speedup_vs"] else "-"
                                          for n in names))
    console.print(table)
    for name in names:
        what = VARIANTS[name] if r["gpu"] or name != "nimble" else "the placed op list in its arena, serially"
        console.print(f"  {SHORT[name]}: {what}")
    if r["trace"]:
        t = r["trace"]
        replay = f"; a graph replay takes {t['replay_median_ms']:.3f} ms" if t["replay_median_ms"] is not None else ""
        console.print(f"trace: {literal(t['path'])} (open in ui.perfetto.dev): the op list issued op by op on "
                      f"{t['streams']} stream(s) took {t['op_list_ms']:.3f} ms{replay}")
    m = r["memory"]
    line = (f"memory: weights {human_bytes(m['weights_bytes'])}, arena {human_bytes(m['arena_bytes'])}, "
            f"scratch {human_bytes(m['scratch_bytes'])}")
    if m["process_peak_bytes"] is not None:
        line += f", process peak {human_bytes(m['process_peak_bytes'])}"
    console.print(line)
    if m["footprint"]:
        console.print(footprint_line(m["footprint"]))
    if "pytorch_graph_streams_pool_bytes" in m:
        pool = m["pytorch_graph_streams_pool_bytes"]
        ours = m["arena_bytes"] + m["scratch_bytes"]
        console.print(f"PyTorch's graph pool for the same multi-stream capture: {human_bytes(pool)}; nimble's arena "
                      f"plus scratch is {ours / max(pool, 1):.2f}x of it")
    from nimble.runtime.base.timing import samples_behind

    more = "raise --duration or --iterations"
    for name, s in r["results"].items():
        if s["cv_percent"] > CV_LIMIT:
            console.print(f"[yellow]warning:[/] {name}: coefficient of variation {s['cv_percent']:.1f}% is above "
                          f"{CV_LIMIT}%; the machine may be busy, or {more}")
    if r["speedup_withheld"]:
        console.print(f"no speedup printed over {', '.join(SHORT[n] for n in r['speedup_withheld'])}: "
                      f"{next(iter(r['speedup_withheld'].values()))}")
    n = min(s["iterations"] for s in r["results"].values())
    thin = [f"p{p:g}" for p in pcts if samples_behind(p, n) < 1]
    if thin:
        console.print(f"[yellow]warning:[/] {', '.join(thin)} rest on {n} timed inferences, too few to differ from "
                      f"the max; {more}")
