"""Replica scaling of `nimble serve`: the same artifact behind 1 and then N replicas, each started
as a user starts it, under the same closed-loop load (`serve_load.load`). On a machine without a
GPU the replicas run on the CPU, each with its share of the cores:

    python benchmarks/serve_scaling.py ARTIFACT --replicas 1 2 --clients 16 --device cpu --out benchmarks/results

Each server is started with `--timeline`: the replicas' own record of their calls gives, per
device, the part of each timed window in which one of them ran (the busy column). On a machine
with GPUs, `--replicas 1 auto` compares one replica with one per GPU, and nvidia-smi, sampled
through each timed window, shows beside it which GPUs were busy and how many processes each held:

    python benchmarks/serve_scaling.py resnet50.nimble --replicas 1 auto --clients 64 --client-procs 4 \
        --device cuda --out benchmarks/results

Several replicas on one GPU, over HTTP and gRPC, at several loads, beside the in-process floor:

    python benchmarks/serve_scaling.py resnet50.nimble --replicas auto --per-gpu 1 4 --protocols http grpc \
        --clients 1 16 64 256 --client-procs 4 --device cuda --in-process --tag grpc --out benchmarks/results
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import report
from nimble.serve import timeline
from nimble.serve.ingress import free_port  # where the server's own processes take none unasked
from serve_load import one_row, one_row_grpc, spread_load


class GpuWatch:
    """nvidia-smi sampled every half second between `start()` and `stop()`: each GPU's mean
    utilization, its most memory used, and the processes that held it."""

    def __init__(self):
        self.samples: dict[str, list[tuple[float, float]]] = {}
        self.index: dict[str, str] = {}
        self.pids: dict[str, set[str]] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _query(what: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]

    def _run(self):
        while not self._done.wait(0.5):
            for index, uuid, util, used in self._query("gpu=index,uuid,utilization.gpu,memory.used"):
                self.index[uuid] = index
                self.samples.setdefault(uuid, []).append((float(util), float(used)))
            for uuid, pid in self._query("compute-apps=gpu_uuid,pid"):
                self.pids.setdefault(uuid, set()).add(pid)

    def start_after(self, seconds: float) -> None:
        """Sample from `seconds` from now (the load's warm-up) until `stop`."""
        self._timer = threading.Timer(seconds, self._thread.start)
        self._timer.start()

    def stop(self) -> list[dict]:
        self._done.set()
        self._timer.cancel()
        self._timer.join()
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()
        return [{"gpu": int(self.index[u]), "utilization_pct": sum(x for x, _ in v) / len(v),
                 "memory_mib": max(m for _, m in v), "processes": sorted(self.pids.get(u, ()))}
                for u, v in sorted(self.samples.items(), key=lambda kv: int(self.index[kv[0]]))]


def gpu_cell(gpus: list[dict]) -> str:
    return "; ".join(f"GPU {g['gpu']}: {g['utilization_pct']:.0f} %, {g['memory_mib']:.0f} MiB, "
                     f"{len(g['processes'])} process{'es' if len(g['processes']) != 1 else ''}" for g in gpus)


def busy_cell(busy: dict[str, float], names: dict[str, str]) -> str:
    """Each device's busy part: GPUs by nvidia-smi's index where `names` maps their UUIDs."""
    return "; ".join(f"{names.get(d, d[:12])}: {part * 100:.0f} %" for d, part in sorted(
        busy.items(), key=lambda item: names.get(item[0], item[0]))) or "-"


def in_process_latency_ms(artifact: Path, device: str) -> float:
    """The artifact's median latency at one row, called in this process: copy in, run, synchronize."""
    import torch

    import nimble

    exe = nimble.load(artifact, device)
    try:
        x = [torch.randn(1, *v.spec.shape[1:]).to(getattr(torch, v.spec.dtype)) for v in
             (exe.graph.values[i] for i in exe.graph.inputs)]
        times = []
        for _ in range(300):
            t = time.perf_counter()
            exe(*x)  # the outputs come back to the host
            if device != "cpu":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
    finally:
        exe.close()
    return sorted(times[50:])[len(times[50:]) // 2]


RUNNING: list[subprocess.Popen] = []  # the servers started, stopped on any exit (`stop_servers`)


def stop_servers() -> None:
    """SIGTERM each server still running (its whole session: it started one of its own), then wait:
    a benchmark cut by a timeout must leave no server holding the GPU and its ports."""
    for proc in RUNNING:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for proc in RUNNING:
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    RUNNING.clear()


def start_server(nimble: list[str], artifact: Path, replicas: str, per_gpu: int, device: str, timeline: Path):
    """`nimble serve` as a user starts it, each replica writing its calls to `timeline`; (process,
    HTTP port, gRPC port, replicas started)."""
    port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen([*nimble, "serve", str(artifact), "--port", str(port), "--grpc-port", str(grpc_port),
                             "--replicas", str(replicas), "--replicas-per-gpu", str(per_gpu), "--device", device,
                             "--metrics-port", str(free_port()), "--timeline", str(timeline)],
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    RUNNING.append(proc)
    started = None
    for line in proc.stderr:
        found = re.search(r"on (\d+) (?:GPU|CPU) replica", line)
        started = int(found.group(1)) if found else started
        if "ready at" in line:
            break
    else:
        return None
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # the pipe never fills
    return proc, port, grpc_port, started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--replicas", nargs="+", default=["1", "2"], help="numbers, or auto (one per GPU)")
    parser.add_argument("--per-gpu", nargs="+", type=int, default=[1], help="--replicas-per-gpu values, each "
                        "with every --replicas")
    parser.add_argument("--protocols", nargs="+", default=["http"], choices=["http", "grpc"])
    parser.add_argument("--clients", nargs="+", type=int, default=[16])
    parser.add_argument("--client-procs", type=int, default=1, help="processes the clients are spread over")
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--warmup", type=float, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--in-process", action="store_true", help="also the artifact's latency at one row, in "
                        "process (the floor of a served request's)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tag", default="", help="written as serve_scaling_DEVICE_TAG.md/.json in --out")
    args = parser.parse_args()
    beside = Path(sys.executable).parent / "nimble"
    nimble = [str(beside)] if beside.exists() else [sys.executable, "-c", "from nimble.cli.entry import main; main()"]
    name = args.artifact.name.removesuffix(".nimble")
    watch_gpus = args.device != "cpu" and shutil.which("nvidia-smi") is not None
    floor = in_process_latency_ms(args.artifact, args.device) if args.in_process else None
    if floor is not None:
        print(json.dumps({"in_process_latency_ms_b1": floor}), flush=True)
    rows = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` sends it: the finally below still runs
    try:
        measure(args, nimble, name, watch_gpus, rows)
    finally:
        stop_servers()
    write_tables(args, rows, floor, watch_gpus)
    return 0


def measure(args, nimble: list[str], name: str, watch_gpus: bool, rows: list) -> None:
    """Every configuration's rows, appended to `rows` as they are measured."""
    for per_gpu in args.per_gpu:
        for n in args.replicas:
            folder = Path(tempfile.mkdtemp(prefix="nimble-timeline-"))
            server = start_server(nimble, args.artifact, n, per_gpu, args.device, folder)
            if server is None:
                raise SystemExit(f"--replicas {n} --replicas-per-gpu {per_gpu}: nimble serve did not start")
            _, port, grpc_port, started = server
            base = f"http://127.0.0.1:{port}/v2/models/{name}"
            metadata = json.loads(urllib.request.urlopen(base, timeout=60).read())
            for protocol in args.protocols:
                target, request = (f"{base}/infer", one_row(metadata)) if protocol == "http" else \
                    (f"127.0.0.1:{grpc_port}", one_row_grpc(name, metadata))
                for clients in args.clients:
                    watch = GpuWatch() if watch_gpus else None
                    if watch:  # the timed window, about: the client processes start and wait a little first
                        watch.start_after(args.warmup + 2.0)
                    procs = min(args.client_procs, clients)
                    row = spread_load(target, clients, procs, args.seconds, args.warmup, request)
                    row |= {"replicas_asked": n, "replicas": started, "per_gpu": per_gpu, "protocol": protocol,
                            "client_procs": procs, "busy": timeline.busy(folder, *row["window"]),
                            "stages": timeline.stages(folder, *row["window"])}
                    if watch:
                        row["gpus"] = watch.stop()
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            stop_servers()
            shutil.rmtree(folder, ignore_errors=True)
            time.sleep(2)


def write_tables(args, rows: list, floor: float | None, watch_gpus: bool) -> None:
    machine = f"{platform.node() or 'this machine'} ({os.cpu_count()} CPU cores"
    if watch_gpus:
        names = [n for (n,) in GpuWatch._query("gpu=name")]
        machine += f", {len(names)} x {names[0]}, torch {importlib.metadata.version('torch')}" if names else ""
    lines = [f"`nimble serve {args.artifact.name} --replicas N --replicas-per-gpu K --device {args.device}` on "
             f"{machine}), {time.strftime('%Y-%m-%d')}; closed-loop clients sending one row each over HTTP (binary "
             f"KServe v2) or gRPC (ModelInfer, raw contents), spread over up to {args.client_procs} client "
             f"process(es) on the same machine, {args.seconds:g} s timed after {args.warmup:g} s. Command: "
             f"`python benchmarks/serve_scaling.py {' '.join(sys.argv[1:])}`."]
    if floor is not None:
        lines.append(f"In-process latency of the artifact at one row (copy in, run, synchronize; median): {floor:.3f} ms.")
    lines.append("Busy: per device, the part of the timed window in which some replica's call ran there, from the "
                 "replicas' own timelines (`nimble serve --timeline`: on a GPU, CUDA events around each call's copy "
                 "in, replay and copy out; on the CPU, the call on the host); calls of replicas that share a GPU "
                 "count once where they overlap.")
    lines += ["", "| --replicas | per GPU | replicas started | protocol | clients | requests/s | p50 ms | p99 ms | errors "
              "| busy (replicas' timelines) |" + (" nvidia-smi in the timed window |" if watch_gpus else ""),
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if watch_gpus else "")]
    names = {uuid: f"GPU {index}" for index, uuid in GpuWatch._query("gpu=index,uuid")} if watch_gpus else {}
    notes = []
    for r in rows:
        if r["errors"]:
            notes.append(f"{r['protocol']} at {r['clients']} clients, --replicas {r['replicas_asked']} --replicas-per-gpu "
                         f"{r['per_gpu']}: errors {', '.join(f'{k} x {n}' for k, n in r['error_kinds'].items())}.")
        cells = " | ".join(f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("p50_ms", "p99_ms"))
        lines.append(f"| {r['replicas_asked']} | {r['per_gpu']} | {r['replicas']} | {r['protocol']} | {r['clients']} | "
                     f"{r['throughput_per_s']:.1f} | {cells} | {r['errors']} | {busy_cell(r['busy'], names)} |"
                     + (f" {gpu_cell(r['gpus'])} |" if watch_gpus else ""))
    lines += [""] + notes if notes else []
    lines += ["", "Where a request's time goes (medians, ms; the replicas' timelines): the client's p50, the part "
              "in the replica from its handler taking the request to the answer encoded, and the rest (the "
              "proxy's and Ray Serve's, both ways; from medians, so an estimate).", "",
              f"| --replicas | per GPU | protocol | clients | client p50 | outside the replica | in the replica | "
              f"{' | '.join(timeline.STAGES)} |", "|" + " --- |" * (7 + len(timeline.STAGES))]
    for r in rows:
        st = r.get("stages")
        if st and r["p50_ms"] is not None:
            lines.append(f"| {r['replicas_asked']} | {r['per_gpu']} | {r['protocol']} | {r['clients']} | "
                         f"{r['p50_ms']:.2f} | {r['p50_ms'] - st['in the replica']:.2f} | {st['in the replica']:.2f} | "
                         + " | ".join(f"{st[k]:.2f}" for k in timeline.STAGES) + " |")
    report.write(args.out, f"serve_scaling_{args.device}" + (f"_{args.tag}" if args.tag else ""), lines,
                 {"rows": rows, "command": sys.argv, "in_process_latency_ms_b1": floor})
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
