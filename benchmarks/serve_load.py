"""Load test of `nimble serve` against the same Ray Serve deployment running the eager module and
torch.compile(mode="reduce-overhead"): closed-loop clients for a fixed time, throughput and
p50/p90/p99 latency. Run on the GPU machine:

    python benchmarks/serve_load.py --out benchmarks/results

Every variant is one Ray Serve application at /v2/models/<variant>, speaking the KServe v2
protocol with binary data (the same decoding and padding for all three: a request batch is padded
to the nearest of --batch-sizes, as a nimble artifact of those batch sizes runs it). Each client
sends one image (1x3x224x224 float32) at a time and waits for the answer. Variants run one after
the other, each alone on the GPU. Also: nimble serve's p50 at one client beside the latency of the
same artifact called in-process (copy in, run, synchronize), the artifact's size against a
single-batch one, and its load time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import report

from ray import serve
from starlette.requests import Request
from starlette.responses import Response


@serve.deployment(ray_actor_options={"num_gpus": 1, "num_cpus": 0}, max_ongoing_requests=64)
class TorchModel:
    """A torchvision model, eager or under torch.compile(mode="reduce-overhead"), behind the same
    protocol code and batching as nimble serve's Model; batches padded to `sizes`."""

    def __init__(self, model: str, compiled: bool, sizes: list[int], delay_s: float):
        import torch

        from nimble.serve.protocol import ModelInfo, TensorInfo

        sys.path.insert(0, str(Path(__file__).parent))
        from zoo import import_torchvision

        torchvision = import_torchvision()
        torch.manual_seed(0)
        self.torch = torch
        self.module = getattr(torchvision.models, model)(weights=None).eval().cuda()
        self.run = torch.compile(self.module, mode="reduce-overhead") if compiled else self.module
        self.sizes = sizes
        with torch.no_grad():
            for b in sizes:  # every shape compiled (and its CUDA graph recorded) before the first request
                for _ in range(3):
                    self.run(torch.randn(b, 3, 224, 224, device="cuda"))
        torch.cuda.synchronize()
        self.info = ModelInfo(model, (TensorInfo("x", "float32", (-1, 3, 224, 224)),),
                              (TensorInfo("y", "float32", (-1, 1000)),), max(sizes), True)
        self.infer_batch.set_max_batch_size(max(sizes))
        self.infer_batch.set_batch_wait_timeout_s(delay_s)
        self.calls, self.rows, self.compute_s = 0, 0, 0.0

    def _infer(self, requests):
        torch = self.torch
        t = time.perf_counter()
        rows = sum(r.rows for r in requests)
        size = min(b for b in self.sizes if b >= rows)
        x = torch.cat([r.tensors[0] for r in requests])
        if size > rows:
            x = torch.cat([x, x.new_zeros((size - rows, 3, 224, 224))])
        with torch.no_grad():
            y = self.run(x.cuda(non_blocking=True)).cpu()
        out, at = [], 0
        for r in requests:
            out.append([y[at:at + r.rows]])
            at += r.rows
        self.calls, self.rows, self.compute_s = self.calls + 1, self.rows + rows, self.compute_s + time.perf_counter() - t
        return out

    @serve.batch(max_batch_size=1, batch_wait_timeout_s=0.002, batch_size_fn=lambda items: sum(r.rows for r in items))
    async def infer_batch(self, requests: list) -> list:
        return await asyncio.to_thread(self._infer, requests)

    async def __call__(self, request: Request) -> Response:
        from nimble.serve.protocol import HEADER_LENGTH, decode, encode

        if request.method == "GET":  # the calls made: rows per call, time per call
            return Response(json.dumps({"calls": self.calls, "rows": self.rows, "compute_s": self.compute_s}).encode())
        decoded = decode(await request.body(), request.headers.get(HEADER_LENGTH.lower()), self.info)
        answer = await self.infer_batch(decoded)
        body, headers = encode(self.info, decoded, answer)
        return Response(body, headers=headers)


def random_row(rng, shape: list[int], datatype: str) -> bytes:
    """Random values of a KServe v2 datatype: floats for FP32/FP16, small integers for the rest."""
    import numpy as np

    if datatype in ("FP32", "FP16"):
        floats = rng.standard_normal(shape, dtype=np.float32)
        return floats.astype(np.float16 if datatype == "FP16" else np.float32).tobytes()
    return rng.integers(0, 100, shape).astype({"INT64": np.int64, "INT32": np.int32}[datatype]).tobytes()


def one_row(metadata: dict) -> tuple[bytes, dict]:
    """A binary KServe v2 request of one row of random values for a model's metadata."""
    import numpy as np

    rng, inputs, blobs = np.random.default_rng(0), [], []
    for i in metadata["inputs"]:
        shape = [1 if d == -1 else d for d in i["shape"]]
        blob = random_row(rng, shape, i["datatype"])
        inputs.append({"name": i["name"], "shape": shape, "datatype": i["datatype"],
                       "parameters": {"binary_data_size": len(blob)}})
        blobs.append(blob)
    head = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    return head + b"".join(blobs), {"Inference-Header-Content-Length": str(len(head))}


async def closed_loop(send, clients: int, start: float, seconds: float, warmup: float) -> tuple[list[float], dict]:
    """`clients` closed-loop callers of `send(k)` (an async call for client k that returns None for a
    good answer, else the kind of error) from `start` (a `time.perf_counter()` reading, which is one
    clock for every process of the machine) for `warmup` + `seconds`: the latencies in ms and the
    count of each kind of error of the timed part."""
    latencies: list[float] = []
    errors: dict[str, int] = {}
    begin, end = start + warmup, start + warmup + seconds
    await asyncio.sleep(max(0.0, start - time.perf_counter()))

    async def client(k):
        while time.perf_counter() < end:
            t = time.perf_counter()
            error = await send(k)
            done = time.perf_counter()
            if t >= begin and done <= end:
                if error is None:
                    latencies.append((done - t) * 1e3)
                else:
                    errors[error] = errors.get(error, 0) + 1

    await asyncio.gather(*(client(k) for k in range(clients)))
    return latencies, errors


async def timed(url: str, clients: int, start: float, seconds: float, warmup: float, request=None) -> tuple[list[float], dict]:
    """`closed_loop` over HTTP: each client posts `request` (body, headers; default one
    1x3x224x224 image for input x) to `url`."""
    import aiohttp

    body, headers = request or one_row({"inputs": [{"name": "x", "shape": [-1, 3, 224, 224], "datatype": "FP32"}]})
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def send(_):
            try:
                async with session.post(url, data=body, headers=headers) as r:
                    await r.read()
                    return None if r.status == 200 else f"HTTP {r.status}"
            except aiohttp.ClientError as e:  # a connection refused or cut is an error of the load, not its end
                return type(e).__name__

        return await closed_loop(send, clients, start, seconds, warmup)


def one_row_grpc(name: str, metadata: dict) -> bytes:
    """The serialized gRPC ModelInferRequest of one row of random values (as `one_row`)."""
    import numpy as np

    from nimble.serve.grpc_protocol import M

    rng, request = np.random.default_rng(0), M["ModelInferRequest"](model_name=name)
    for i in metadata["inputs"]:
        shape = [1 if d == -1 else d for d in i["shape"]]
        request.inputs.add(name=i["name"], datatype=i["datatype"], shape=shape)
        request.raw_input_contents.append(random_row(rng, shape, i["datatype"]))
    return request.SerializeToString()


async def timed_grpc(target: str, clients: int, start: float, seconds: float, warmup: float, request: bytes,
                     channels: int = 4) -> tuple[list[float], dict]:
    """`closed_loop` over the KServe v2 gRPC protocol: each client calls ModelInfer with the
    serialized `request`, the clients spread over `channels` HTTP/2 connections to `target`
    (host:port)."""
    import grpc

    options = [("grpc.max_send_message_length", 2**30), ("grpc.max_receive_message_length", 2**30)]
    opened = [grpc.aio.insecure_channel(target, options=options) for _ in range(max(1, min(channels, clients)))]
    calls = [c.unary_unary("/inference.GRPCInferenceService/ModelInfer") for c in opened]  # bytes in, bytes out

    async def send(k):
        try:
            await calls[k % len(calls)](request)
            return None
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {(e.details() or '')[:80]}"

    try:
        return await closed_loop(send, clients, start, seconds, warmup)
    finally:
        for c in opened:
            await c.close()


def load_figures(latencies: list[float], errors: dict[str, int], clients: int, begin: float, seconds: float) -> dict:
    """Throughput and latency percentiles of a load timed from `begin` (on `time.perf_counter()`: one
    clock for every process of the machine) for `seconds`, and its errors by kind."""
    latencies = sorted(latencies)

    def pct(p):
        return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))] if latencies else None

    return {"clients": clients, "requests": len(latencies), "errors": sum(errors.values()), "error_kinds": errors,
            "seconds": seconds, "window": [begin, begin + seconds],
            "throughput_per_s": len(latencies) / seconds, "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99)}


async def load(url: str, clients: int, seconds: float, warmup: float, request=None) -> dict:
    """`clients` closed-loop clients in this process for `warmup` + `seconds`; what the timed part saw."""
    start = time.perf_counter()
    latencies, errors = await timed(url, clients, start, seconds, warmup, request)
    return load_figures(latencies, errors, clients, start + warmup, seconds)


def spread_load(url: str, clients: int, procs: int, seconds: float, warmup: float, request=None) -> dict:
    """`load` with the clients spread over `procs` processes, so that one Python client process does
    not limit what several replicas can serve; one timed window for all of them. A `url` without
    http:// is a gRPC target (host:port), and `request` the serialized ModelInferRequest."""
    import concurrent.futures
    import multiprocessing

    if procs <= 1 and url.startswith("http"):
        return asyncio.run(load(url, clients, seconds, warmup, request))
    procs = max(1, procs)
    shares = [clients // procs + (i < clients % procs) for i in range(procs)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=context) as pool:
        list(pool.map(time.sleep, [0.5] * procs))  # every worker started and its imports done
        start = time.perf_counter() + 1.0
        parts = list(pool.map(_timed_in_process, [(url, n, start, seconds, warmup, request) for n in shares if n]))
    kinds: dict[str, int] = {}
    for _, errors in parts:
        for kind, n in errors.items():
            kinds[kind] = kinds.get(kind, 0) + n
    return load_figures([ms for lat, _ in parts for ms in lat], kinds, clients, start + warmup, seconds)


def _timed_in_process(job: tuple) -> tuple[list[float], dict]:
    return asyncio.run(timed(*job) if job[0].startswith("http") else timed_grpc(*job))


def calls(port: int, variant: str) -> dict:
    """The replica's count of calls, rows and compute seconds so far (nimble: Triton's statistics)."""
    import urllib.request

    path = "stats" if variant == "nimble" else "infer"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{variant}/{path}", timeout=30) as r:
        doc = json.loads(r.read())
    if variant != "nimble":
        return doc
    s = doc["model_stats"][0]
    return {"calls": s["execution_count"], "rows": s["inference_count"],
            "compute_s": s["inference_stats"]["compute_infer"]["ns"] / 1e9}


def build(model: str, sizes: list[int], folder: Path) -> dict:
    """The nimble artifact of `sizes`, and facts about it: its size beside a single-batch one's,
    its warm load time, and its in-process latency at batch 1."""
    import torch

    import nimble
    from nimble.formats import write_artifact
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs
    from zoo import import_torchvision

    torchvision = import_torchvision()
    torch.manual_seed(0)
    module = getattr(torchvision.models, model)(weights=None).eval()
    pt = folder / f"{model}.pt"
    torch.jit.save(torch.jit.trace(module, torch.randn(1, 3, 224, 224)), str(pt))
    t = time.perf_counter()
    multi = write_artifact(folder / f"{model}.nimble", compile_model(pt, input_specs(["1x3x224x224"]),
                                                                     batch_sizes=sizes).artifact())
    compile_s = time.perf_counter() - t
    single = write_artifact(folder / f"{model}_1.nimble", compile_model(pt, input_specs(["1x3x224x224"])).artifact())
    loads = []
    for _ in range(2):  # the second is warm: kernels and tuning cached
        t = time.perf_counter()
        exe = nimble.load(folder / f"{model}.nimble")
        loads.append(time.perf_counter() - t)
        if _ == 0:
            exe.close()
    x = torch.randn(1, 3, 224, 224)
    times = []
    for _ in range(300):
        t = time.perf_counter()
        exe(x)  # copy in, run, synchronize (the output comes back to the host)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    exe.close()
    return {"batch_sizes": sizes, "compile_s": compile_s, "artifact_bytes": multi, "single_batch_bytes": single,
            "size_ratio": multi / single, "load_s_cold": loads[0], "load_s_warm": loads[1],
            "in_process_latency_ms_b1": statistics.median(times[50:])}


def summary(doc: dict) -> str:
    meta, facts, rows = doc["meta"], doc["artifact"], doc["rows"]
    lines = [f"`nimble serve` under load, {meta['gpu']}, torch {meta['torch']}, {meta['date']}. Command: "
             f"`{meta['command']}`. {doc['model']} fp32, one image (1x3x224x224) per request, binary KServe v2 "
             f"requests from closed-loop asyncio clients on the same machine, {doc['seconds']:g} s timed after "
             f"{doc['warmup']:g} s warm-up; batch sizes {facts['batch_sizes']}, --max-batch-delay-ms "
             f"{doc['delay_ms']:g}; one replica on the one GPU; ingress: {doc.get('ingress', 'proxy')}.", "",
             "| variant | clients | throughput /s | p50 ms | p90 ms | p99 ms | errors | rows per call | "
             "compute ms per call |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [f"{r[k]:.2f}" if r.get(k) is not None else "-" for k in ("p50_ms", "p90_ms", "p99_ms")]
        lines.append(f"| {r['variant']} | {r['clients']} | {r['throughput_per_s']:.1f} | {' | '.join(cells)} | "
                     f"{r['errors']} | {r['rows_per_call']:.2f} | {r['compute_ms_per_call']:.2f} |")
    lines += ["", f"Artifact: {facts['artifact_bytes'] / 2**20:.1f} MiB for batch sizes {facts['batch_sizes']} against "
              f"{facts['single_batch_bytes'] / 2**20:.1f} MiB for batch 1 alone ({facts['size_ratio']:.3f}x); "
              f"compiled in {facts['compile_s']:.1f} s; loaded in {facts['load_s_cold']:.2f} s cold and "
              f"{facts['load_s_warm']:.2f} s warm (one CUDA graph per batch size). In-process latency at batch 1 "
              f"(copy in, run, synchronize, median): {facts['in_process_latency_ms_b1']:.3f} ms."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--warmup", type=float, default=3)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    parser.add_argument("--variants", nargs="*", default=["nimble", "eager", "torch_compile"])
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--ingress", choices=["haproxy", "proxy"], default="haproxy",
                        help="Ray Serve's HAProxy ingress (nimble serve's default) or its Python HTTP proxy")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import ray

    from nimble.serve import ingress
    from nimble.serve.app import Model

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    meta = report.gpu_meta("serve_load.py")
    doc = {"meta": meta, "model": args.model, "seconds": args.seconds, "warmup": args.warmup,
           "delay_ms": args.delay_ms, "ingress": args.ingress, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        doc["artifact"] = facts = build(args.model, sizes, Path(tmp))
        print(json.dumps(facts), flush=True)
        folder = ingress.private_folder()
        if args.ingress == "haproxy":  # as nimble serve sets it: every variant behind the same ingress
            os.environ.update(ingress.haproxy_environment(folder, ingress.real_haproxy()))
        ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": args.port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        for variant in args.variants:
            t = time.perf_counter()
            if variant == "nimble":
                app = Model.options(name="nimble", ray_actor_options={"num_gpus": 1, "num_cpus": 0},
                                    max_ongoing_requests=64).bind(
                    str(Path(tmp) / f"{args.model}.nimble"), variant, "cuda", "cached", args.delay_ms / 1e3,
                    64 * 2**20, 0, str(folder), 5.0)
            else:
                app = TorchModel.bind(args.model, variant == "torch_compile", sizes, args.delay_ms / 1e3)
            try:
                serve.run(app, name=variant, route_prefix=f"/v2/models/{variant}")
            except Exception as e:  # a variant that fails to start is a result too
                print(f"{variant}: FAILED to start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                continue
            started = time.perf_counter() - t
            url = f"http://127.0.0.1:{args.port}/v2/models/{variant}/infer"
            for clients in ([1, args.clients] if variant == "nimble" else [args.clients]):
                before = calls(args.port, variant)
                row = asyncio.run(load(url, clients, args.seconds, args.warmup))
                after = calls(args.port, variant)
                done = after["calls"] - before["calls"]
                row |= {"variant": variant, "start_s": started, "rows_per_call": (after["rows"] - before["rows"]) / max(done, 1),
                        "compute_ms_per_call": 1e3 * (after["compute_s"] - before["compute_s"]) / max(done, 1)}
                doc["rows"].append(row)
                print(json.dumps(row), flush=True)
                report.write(args.out, "serve_load", doc=doc)
            serve.delete(variant)
        serve.shutdown()
    report.write(args.out, "serve_load", summary(doc), doc)
    print(summary(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
