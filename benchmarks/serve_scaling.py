"""Replica scaling of `nimble serve`: the same artifact behind 1 and then N replicas, each started
as a user starts it, under the same closed-loop load (`serve_load.load`). On a machine without a
GPU the replicas run on the CPU, each with its share of the cores:

    python benchmarks/serve_scaling.py ARTIFACT --replicas 1 2 --clients 16 --device cpu --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import report
from serve_load import load, one_row


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--warmup", type=float, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    nimble = str(Path(sys.executable).parent / "nimble")
    name = args.artifact.name.removesuffix(".nimble")
    rows = []
    for n in args.replicas:
        port = free_port()
        proc = subprocess.Popen([nimble, "serve", str(args.artifact), "--port", str(port), "--replicas", str(n),
                                 "--device", args.device, "--metrics-port", str(free_port())],
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        for line in proc.stderr:
            if "ready at" in line:
                break
        else:
            print(f"{n} replicas: nimble serve did not start", file=sys.stderr)
            return 1
        base = f"http://127.0.0.1:{port}/v2/models/{name}"
        metadata = json.loads(urllib.request.urlopen(base, timeout=60).read())
        row = asyncio.run(load(f"{base}/infer", args.clients, args.seconds, args.warmup, one_row(metadata)))
        row["replicas"] = n
        rows.append(row)
        print(json.dumps(row), flush=True)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
        time.sleep(2)
    base = rows[0]["throughput_per_s"]
    lines = [f"`nimble serve {args.artifact.name} --replicas N --device {args.device}` on {platform.node() or 'this machine'} "
             f"({os.cpu_count()} CPU cores), {time.strftime('%Y-%m-%d')}; {args.clients} closed-loop clients sending one row "
             f"each, {args.seconds:g} s timed after {args.warmup:g} s. Command: `python benchmarks/serve_scaling.py "
             f"{' '.join(sys.argv[1:])}`.", "",
             "| replicas | requests/s | vs 1 replica | p50 ms | p99 ms | errors |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['replicas']} | {r['throughput_per_s']:.1f} | {r['throughput_per_s'] / base:.2f}x | "
                     f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} |")
    report.write(args.out, f"serve_scaling_{args.device}", lines, {"rows": rows, "command": sys.argv})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
