"""A GPU sweep of every torchvision classification model: nimble against torch.compile and its kernels.

Run on a GPU machine; the report needs none.

    python benchmarks/sweep.py --out DIR [--shard 0/2] [--models ...] [--batches 1 8] [--budget 540]
    python benchmarks/sweep.py --precision bf16 --batches 8 --out DIR [--shard ...]
    python benchmarks/sweep.py --out DIR --skip-done benchmarks/results/sweep_*.jsonl   # go on where it stopped
    python benchmarks/sweep.py --out DIR --jobs 3 --timeout 400 ...   # three models at once, GPU turns
    python benchmarks/sweep.py --peer max-autotune --models resnet50 inception_v3 bert-base --batches 8 \
                               --timeout 580 --out DIR        # the next peer, one model a device call
    python benchmarks/sweep.py --report DIR/sweep_*.jsonl --out benchmarks/results     # merge, no GPU

Each model runs in a process of its own (a crash, a hang or a leak stays with it) with `--timeout`
seconds for all its batches; its rows are appended to `DIR/sweep_<precision>_<tag>.jsonl` as they
come, so a device call cut short keeps what it measured. `--budget` seconds after the start no
new model begins (a device call's limit is 10 minutes); `--skip-done` skips the models that those
files already hold at every batch asked for, so the next call goes on. `--shard I/N` takes every
N-th model of the sorted list from the I-th: one process per GPU, `CUDA_VISIBLE_DEVICES` apart.
`--jobs N` runs N models at once on one GPU: they compile side by side and take turns for what
they time (`gpu_turns.py`: each variant's figures, and nimble's load, which times its candidates,
hold a lock and stop the other model processes meanwhile). A wait for a turn counts in `--timeout`.

fp32 (TF32 in convolutions, PyTorch's default), per model and batch, in one process, each output
checked against eager:
- eager PyTorch;
- `inductor_graph` (at `--alone-batches`, 8 by default): torch.compile's kernels without its call
  path: Inductor with no CUDA graphs of its own, captured by hand into one CUDA graph and replayed;
- `torch_compile`: torch.compile(mode="reduce-overhead"), with its compile time;
- `nimble`: the model traced, compiled (checked on the GPU), written and read back as an artifact,
  loaded with full tuning.
Two figures each, as medians: GPU-bound (50 back-to-back calls between CUDA events, median of 15)
and latency (copy in where the variant copies, run, synchronize; median of 200); eager, a reference
and no peer, with fewer (10 calls, median of 5; median of 40).

`--peer max-autotune` compares with torch.compile(mode="max-autotune") instead (its variant
`max_autotune`, its compile time beside it; Inductor alone is not run): it tunes its convolution and
matrix-multiply templates for minutes per model, so give each model a device call of its own and
keep Inductor's cache (TORCHINDUCTOR_CACHE_DIR) between calls where the machine stays warm.
BERT-base and GPT-2 are there too, built as `peers.py` builds them.

bf16: `peers.py`'s reduced-precision row (the module cast whole, eager and torch.compile on it;
nimble compiled with --precision bf16, reduced inputs and outputs), top-1 agreement over one batch.

The report is one table per precision and batch with nimble's ratio to each peer, the geometric
mean of the ratios and the worst ten.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import gpu_turns
import report
from sweep_report import PEERS, first_meta, kind, ratio, read_rows, summary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

LAST = ("vit_h_14", "regnet_y_128gf", "vit_l_16", "vit_l_32", "regnet_y_32gf", "efficientnet_b7", "efficientnet_v2_l",
        "convnext_large", "swin_v2_b", "swin_b", "regnet_x_32gf", "efficientnet_b6", "regnet_y_16gf")  # slowest


def models() -> list[str]:
    """Every torchvision classification model, the largest (slowest to compile) last."""
    import zoo

    torchvision = zoo.import_torchvision()
    names = sorted(torchvision.models.list_models(module=torchvision.models))
    return [n for n in names if n not in LAST] + [n for n in LAST if n in names]


def shard(names: list[str], spec: str) -> list[str]:
    """`I/N`: every N-th name from the I-th."""
    try:
        i, n = (int(p) for p in spec.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise SystemExit(f"--shard {spec}: give I/N with 0 <= I < N, as 0/2")
    return names[i::n]


@functools.cache
def _model(name: str):
    """`peers.make_model(name)`, built once per process: (the model, its input shapes)."""
    import peers

    return peers.make_model(name)


def build(name: str, batch: int):
    """(the model in eval mode with random weights, on the CPU; its input batch on the CPU), as
    `peers.py` builds them (any torchvision classification model; BERT-base and GPT-2 for
    `--peer max-autotune`), a model once per process."""
    import torch

    import peers

    if name in peers.HUGGING_FACE:
        return peers.make_inputs(name, batch)
    model, shapes = _model(name)
    torch.manual_seed(1)
    return model.cpu(), [torch.randn(batch, *s) for s in shapes]


def hand_graph(fn, xs):
    """`fn(*xs)` captured into one CUDA graph after three warm calls on a side stream: (the graph,
    its input tensors, its output)."""
    import torch

    static = [x.clone() for x in xs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    graph.replay()
    torch.cuda.synchronize()
    return graph, static, out


def bench_fp32(name: str, batch: int, tmp: Path, alone: bool, peer: str = "reduce-overhead") -> dict:
    """The row of one model at one batch; `alone`: with Inductor's kernels alone too; `peer`:
    torch.compile's mode (max-autotune: its variant is `max_autotune`, and Inductor alone is not run)."""
    import torch

    import peers
    from nimble.formats import read_artifact, write_artifact
    from nimble.frontend import quiet_torchscript
    from nimble.pipeline import compile_model
    from nimble.runtime.base.compare import compare
    from nimble.runtime.executable import Executable
    from nimble.specs import input_specs

    model, xs_cpu = build(name, batch)
    xs = [x.cuda() for x in xs_cpu]
    clock = [time.perf_counter()]

    def stage(what):  # each stage's seconds on stderr: the log says where a slow model's time went
        now = time.perf_counter()
        print(f"{name} b{batch}: {what} {now - clock[0]:.1f} s", file=sys.stderr, flush=True)
        clock[0] = now

    row: dict = {"model": name, "batch": batch, "precision": "fp32", "peer": peer, "gpu_bound_ms": {},
                 "latency_ms": {}, "check": {}, "errors": {}}

    def record(variant, call, sync_call=None, short=False):  # short: eager, a reference figure, not a peer
        with gpu_turns.turn():
            row["gpu_bound_ms"][variant] = peers.gpu_bound_ms(call, *((10, 5) if short else ()))
            row["latency_ms"][variant] = report.median_ms(sync_call or call, *((40,) if short else ()))

    def check(variant, out):
        out = [out] if isinstance(out, torch.Tensor) else list(out)
        row["check"][variant] = compare([o.clone() for o in out], ref, 1e-2, 1e-3).max_rel

    with torch.no_grad():
        with quiet_torchscript():
            pt = tmp / f"{name}_{batch}.pt"
            torch.jit.save(torch.jit.trace(model, tuple(xs_cpu), check_trace=False), str(pt))
        gpu = model.cuda()
        ref = gpu(*xs)
        ref = [ref] if isinstance(ref, torch.Tensor) else list(ref)
        record("eager", lambda: gpu(*xs), short=True)
        stage("eager")
        try:
            if not alone or peer != "reduce-overhead":
                raise LookupError("not at this batch, or not beside this peer")
            torch._dynamo.reset()
            plain = torch.compile(gpu)
            t = time.perf_counter()
            for _ in range(3):
                plain(*xs)
            torch.cuda.synchronize()
            row["inductor_compile_s"] = time.perf_counter() - t
            graph, static, out = hand_graph(plain, xs)
            check("inductor_graph", out)
            record("inductor_graph", graph.replay, lambda: ([s.copy_(x) for s, x in zip(static, xs)], graph.replay()))
            graph = static = out = plain = None  # their memory goes before the next variant
        except LookupError:
            pass
        except Exception as e:  # a model Inductor cannot capture is a result too
            row["errors"]["inductor_graph"] = f"{type(e).__name__}: {str(e)[:300]}"
        stage("inductor_graph")
        torch._dynamo.reset()
        variant = PEERS[peer]
        compiled, out = peers.torch_compile(gpu, xs, row, record, peer, variant)
        check(variant, out)
        stage(variant)
        del compiled, out
        torch._dynamo.reset()
        torch.cuda.empty_cache()

    specs = input_specs(["x".join(map(str, x.shape)) for x in xs_cpu], [str(x.dtype).removeprefix("torch.") for x in xs_cpu])
    t = time.perf_counter()
    c = compile_model(pt, specs, device="cuda")
    row["nimble_compile_s"] = time.perf_counter() - t
    stage("nimble compile")
    path = tmp / f"{name}_{batch}.nimble"
    write_artifact(path, c.artifact())
    with gpu_turns.turn():  # its load times candidates: one turn with its figures
        exe = Executable(read_artifact(path), "cuda", tune="full")
        check("nimble", exe.run(*xs))
        record("nimble", exe.replay, lambda: exe(*xs, copy=False))
    row["nimble_load_s"] = exe.stats.seconds.get("total")
    row["choice"] = exe.stats.choice
    row["ops"] = len(c.graph.ops)
    exe.close()
    stage("nimble")
    return row


def bench_bf16(name: str, batch: int, tmp: Path) -> dict:
    import peers

    with gpu_turns.turn():  # its loads and figures are not apart: the whole row is one turn
        return peers.bench_reduced(name, batch, "bf16", tmp, agreement_inputs=batch, make=build)


def child(name: str, batches: list[int], precision: str, alone: list[int], peer: str) -> int:
    """One model at each batch, a JSON row printed per batch (or {"error": ...})."""
    gpu_turns.join()  # a member of the sweep's turns, where models run side by side
    import torch

    torch.backends.cudnn.benchmark = False
    one = (lambda n, b, t: bench_fp32(n, b, t, b in alone, peer)) if precision == "fp32" else bench_bf16
    with tempfile.TemporaryDirectory() as tmp:
        for batch in batches:
            try:
                row = one(name, batch, Path(tmp))
            except Exception as e:  # the next batch may still run
                row = {"model": name, "batch": batch, "precision": precision,
                       "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
            print("ROW " + json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    return 0


def run_model(name: str, batches: list[int], precision: str, timeout: float, log, alone=(8,),
              peer: str = "reduce-overhead", env: dict | None = None) -> list[dict]:
    """The model's rows from a process of its own (with `env`, where given); a timeout or a crash
    is a row for each batch it left without one."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--precision", precision,
           "--batches", *map(str, batches), "--alone-batches", *map(str, alone), "--peer", peer]
    lock = (env or {}).get(gpu_turns.LOCK_ENV)  # side by side: a process group of its own (`gpu_turns`)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            errors="replace", start_new_session=bool(lock))
    try:
        out, err = proc.communicate(timeout=timeout)
        why = None if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        why = f"timeout {timeout:.0f} s"
    finally:
        if lock:  # its compile workers go with it; neighbours it stopped continue
            gpu_turns.leave(lock, proc.pid)
            gpu_turns.continue_all(lock)
    log.write(err[-4000:])
    rows = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
    done = {r["batch"] for r in rows}
    rows += [{"model": name, "batch": b, "precision": precision, "peer": peer, "error": why or "no row"}
             for b in batches if b not in done]
    return rows


def scheduled(names: list[str], jobs: int, one, may_start):
    """`one(name)` for each name, up to `jobs` at once, each started only while `may_start()`
    holds; their results as they finish."""
    with ThreadPoolExecutor(jobs) as pool:
        waiting, running = list(names), set()
        while waiting or running:
            while waiting and len(running) < jobs:
                if not may_start():
                    print(f"budget spent: {len(waiting)} model(s) left for the next call", flush=True)
                    waiting = []
                    break
                running.add(pool.submit(one, waiting.pop(0)))
            if running:
                finished, running = wait(running, return_when=FIRST_COMPLETED)
                yield from (f.result() for f in finished)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=False)
    parser.add_argument("--models", nargs="*", help="default: every torchvision classification model")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--shard", default="0/1", help="I/N: every N-th model from the I-th")
    parser.add_argument("--alone-batches", type=int, nargs="*", default=[8],
                        help="fp32: the batches where Inductor's kernels alone are timed too")
    parser.add_argument("--peer", choices=list(PEERS), default="reduce-overhead",
                        help="fp32: torch.compile's mode to compare with (max-autotune: slow to compile; give "
                             "TORCHINDUCTOR_CACHE_DIR a folder kept between calls, and a --timeout to match)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per model, all its batches")
    parser.add_argument("--budget", type=float, default=None, help="seconds after which no new model starts")
    parser.add_argument("--skip-done", type=Path, nargs="*", default=[], help="JSONL files whose models to skip")
    parser.add_argument("--jobs", type=int, default=1,
                        help="models at once: they compile side by side and take turns on the GPU for what "
                             "they time, the others stopped meanwhile (gpu_turns.py); waits count in --timeout")
    parser.add_argument("--tag", default="run")
    parser.add_argument("--report", type=Path, nargs="*", help="merge these JSONL files into sweep.md")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return child(args.one, args.batches, args.precision, args.alone_batches, args.peer)
    if args.out is None:
        parser.error("--out DIR is needed")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give 1 or more models at once")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        rows = read_rows(args.report)
        metas = [first_meta(p) for p in args.report]
        meta = {**metas[0], "command": " ; ".join(m["command"] for m in metas)}
        text = summary(rows, meta)
        report.write(args.out, "sweep", text, {"meta": meta, "rows": rows})
        print(text)
        return 0
    start = time.monotonic()
    names = shard(args.models or models(), args.shard)
    done = {(r["model"], r["batch"]) for r in read_rows(args.skip_done)
            if "error" not in r and kind(r) == (args.precision, args.peer)}
    names = [n for n in names if not all((n, b) in done for b in args.batches)]
    sink = args.out / f"sweep_{args.precision}_{args.tag}.jsonl"
    with sink.open("a") as out, (args.out / f"sweep_{args.precision}_{args.tag}.log").open("a") as log:
        if sink.stat().st_size == 0:
            import torch

            meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/sweep.py " + " ".join(sys.argv[1:])}
            out.write(json.dumps({"meta": meta}) + "\n")
        lock = args.out / f".gpu_turns_{os.getpid()}.lock"  # this run's: no stale member is ever stopped
        env = {**os.environ, gpu_turns.LOCK_ENV: str(lock)} if args.jobs > 1 else None

        def one(name: str) -> tuple[str, float, list[dict]]:
            t = time.monotonic()
            return name, t, run_model(name, args.batches, args.precision, args.timeout, log, args.alone_batches,
                                      args.peer, env)
        for name, t, rows in scheduled(names, args.jobs, one,
                                       lambda: args.budget is None or time.monotonic() - start <= args.budget):
            for row in rows:
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(f"{name} b{row['batch']}: " + (row.get("error") or " ".join(
                    f"{p}={ratio(row, p):.3f}" for p in (*PEERS.values(), "inductor_graph") if ratio(row, p))),
                    f"({time.monotonic() - t:.0f} s)", flush=True)
            log.flush()
    gpu_turns.forget(str(lock))
    return 0


if __name__ == "__main__":
    sys.exit(main())
