"""`nimble serve` on Ray Serve: one application per artifact at /v2/models/<name>, one at /v2 for
the server's own routes, and the command's lifecycle (start, ready line, clean shutdown).

Each model is a deployment of `replicas` replicas; each replica loads the artifact once (a
`Replica`) and holds one GPU (`num_gpus=1`; Ray sets CUDA_VISIBLE_DEVICES) or, where there is
none, runs on the CPU. A request that finds its replica idle runs at once; the others are batched
by Ray Serve's `serve.batch`, counted in rows, up to the artifact's largest batch size or until
`delay` passes. A replica takes at most
`max_ongoing` requests at once; beyond them up to `max_queue` wait in Ray's queue, and the rest are
answered 503 at once. Ray replaces a replica that dies; the requests it held get errors.

Routes (the KServe v2 protocol, and Triton's statistics extension):
    GET  /v2                           server metadata
    GET  /v2/health/live, /ready       200 once up
    GET  /v2/models/<name>[/versions/1]           model metadata
    GET  /v2/models/<name>[/versions/1]/ready     200 when a replica has loaded it
    POST /v2/models/<name>[/versions/1]/infer     inference (JSON, and the binary data extension)
    GET  /v2/models/<name>[/versions/1]/stats     the answering replica's statistics
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from .. import __version__
from ..errors import ExecutionError, NimbleError, first_line
from . import ingress, reaper
from .protocol import HEADER_LENGTH, ProtocolError, decode, encode, error_body
from .replica import Replica

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MODEL_ROUTE = re.compile(r"^(?:/versions/1)?(/ready|/infer|/stats)?/?$")


def _json(doc, status: int = 200) -> Response:
    return Response(json.dumps(doc).encode(), status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return Response(error_body(message), status_code=status, media_type="application/json")


def _unavailable() -> Response:
    """What a draining server answers a new request: try again (elsewhere) in a second."""
    return Response(error_body("the server is shutting down; send the request again (to another server)"),
                    status_code=503, media_type="application/json", headers={"Retry-After": "1"})


DRAIN_BYTES = 2**30  # a refused body is read and dropped up to this, so that the client reads the 413
BODY_SECONDS_PER_MIB = 2.0  # a body's deadline: --body-timeout, plus this per MiB it declares ...
BODY_SECONDS_CAP = 60.0  # ... and never more than this


def body_deadline(length: str | None, limit: int, base_s: float) -> float:
    """Seconds a request body may take to arrive: `base_s` plus BODY_SECONDS_PER_MIB for each MiB
    it declares (or may hold, without a Content-Length), capped."""
    size = int(length) if length is not None and length.isdigit() and len(length) < 20 else limit
    return min(base_s + BODY_SECONDS_PER_MIB * min(size, limit) / 2**20, BODY_SECONDS_CAP)


async def _body_within(request: Request, limit: int, base_s: float) -> bytes:
    """The body, read before the request counts as the replica's; 408 past its deadline."""
    deadline = body_deadline(request.headers.get("content-length"), limit, base_s)
    try:
        return await asyncio.wait_for(_body(request, limit), deadline)
    except asyncio.TimeoutError:
        raise ProtocolError(408, f"the request body did not arrive within {deadline:.0f} s; send it at once (the "
                            "server allows --body-timeout seconds plus 2 s per MiB)") from None


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes. Nothing past the limit is kept: the
    rest is read and dropped (up to DRAIN_BYTES), because a client still sending when the answer
    comes sees a broken pipe, not the 413."""
    length = request.headers.get("content-length")
    if length is not None and not length.isdigit():
        raise ProtocolError(400, f"Content-Length {length[:20]!r} is not a number of bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit or (length is not None and int(length) > limit):
            chunks = []
            if size > DRAIN_BYTES:
                break
            continue
        chunks.append(chunk)
    if size > limit or (length is not None and int(length) > limit):
        raise ProtocolError(413, f"the request body is {length or 'over ' + str(limit)} bytes, over the limit of "
                            f"{limit}; send fewer rows per request, or start the server with a larger --max-body")
    return b"".join(chunks)


# the drain (`stop`) already waited for the requests in flight: Ray's own wait after it need not be long
SHUTDOWN = {"graceful_shutdown_timeout_s": 5.0, "graceful_shutdown_wait_loop_s": 0.2}


@serve.deployment(**SHUTDOWN)
class Model:
    """One artifact behind /v2/models/<name>."""

    def __init__(self, path: str, name: str, device: str, tune: str, delay_s: float, max_body: int,
                 threads: int, folder: str, body_timeout_s: float):
        import threading
        import uuid

        import torch
        from ray.serve import metrics

        if threads:
            torch.set_num_threads(threads)
        tags = ("model",)
        self._rows = metrics.Histogram("nimble_batch_rows", "rows per call the replica ran (after batching)",
                                       [1, 2, 4, 8, 16, 32, 64, 128], tags)
        self._queue = metrics.Histogram("nimble_queue_ms", "time a request waited to be batched, ms",
                                        [0.5, 1, 2, 5, 10, 20, 50, 100, 500], tags)
        self._gpu = metrics.Histogram("nimble_compute_ms", "time one call took on the device, ms",
                                      [0.5, 1, 2, 5, 10, 20, 50, 100, 500], tags)
        self._tags = {"model": name}
        self.replica = Replica(path, name, device, tune, observe=self._observe)
        self.info = self.replica.info
        self._max_body = max_body
        self.infer_batch.set_max_batch_size(self.info.max_batch)
        self.infer_batch.set_batch_wait_timeout_s(delay_s)
        self._busy = 0  # requests this replica is running or batching (one event loop: no lock needed)
        self._held = 0  # requests this replica answers now, their bodies still arriving included
        self._folder, self._body_timeout_s = folder, body_timeout_s
        self._marker = ingress.idle_marker(folder, uuid.uuid4().hex)
        threading.Thread(target=self._watch_drain, daemon=True).start()

    def _watch_drain(self) -> None:
        """Once the server drains, keep a marker file while this replica holds no request."""
        while True:
            time.sleep(0.05)
            if ingress.draining(self._folder):
                if self._held == 0:
                    Path(self._marker).touch()
                else:
                    Path(self._marker).unlink(missing_ok=True)

    def _observe(self, rows: int, queue_s: float, compute_s: float) -> None:
        self._rows.observe(rows, self._tags)
        self._queue.observe(queue_s * 1e3, self._tags)
        self._gpu.observe(compute_s * 1e3, self._tags)

    @serve.batch(max_batch_size=1, batch_wait_timeout_s=0.002, batch_size_fn=lambda items: sum(r.rows for r in items))
    async def infer_batch(self, requests: list) -> list:
        return await asyncio.to_thread(self.replica.infer, requests)

    async def __call__(self, request: Request) -> Response:
        prefix = request.scope.get("root_path", "")
        path = request.url.path[len(prefix):] if request.url.path.startswith(prefix) else request.url.path
        route = MODEL_ROUTE.match(path)
        if route is None:
            return _error(404, f"no route {request.url.path[:200]}; see GET /v2/models/{self.info.name}")
        what = route.group(1)
        if what in ("/infer", "/ready") and ingress.draining(self._folder):
            return _unavailable()
        self._held += 1
        try:
            if what == "/infer":
                if request.method != "POST":
                    return _error(405, "infer takes POST")
                return await self._infer(request)
            if request.method != "GET":
                return _error(405, f"{request.url.path[:200]} takes GET")
            if what == "/ready":
                return _json({})
            if what == "/stats":
                return _json(self.replica.stats.document(self.info.name))
            return _json(self.info.metadata())
        except ProtocolError as e:
            return _error(e.status, str(e))
        except Exception as e:  # a fault of nimble's: one line for the client, the traceback in the replica's log
            import logging

            logging.getLogger("ray.serve").exception("nimble serve: %s failed", request.url.path)
            return _error(500, f"internal error ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                          "the replica's log has the traceback")
        finally:
            self._held -= 1

    async def _infer(self, request: Request) -> Response:
        body = await _body_within(request, self._max_body, self._body_timeout_s)
        decoded = decode(body, request.headers.get(HEADER_LENGTH.lower()), self.info)
        decoded.received = time.perf_counter()
        self._busy += 1
        try:  # a request that finds the replica idle runs at once: waiting could batch it with nothing
            answer = (await asyncio.to_thread(self.replica.infer, [decoded]))[0] if self._busy == 1 else \
                await self.infer_batch(decoded)
        finally:
            self._busy -= 1
        if isinstance(answer, ProtocolError):
            raise answer
        content, headers = encode(self.info, decoded, answer)
        return Response(content, headers=headers)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, **SHUTDOWN)
class Server:
    """The server's own routes under /v2, and a JSON 404 for an unknown model."""

    def __init__(self, models: list[str], folder: str):
        self.models, self._folder = models, folder

    async def __call__(self, request: Request) -> Response:
        prefix = request.scope.get("root_path", "")
        path = request.url.path[len(prefix):].rstrip("/") if request.url.path.startswith(prefix) else ""
        if path == "/health/ready" and ingress.draining(self._folder):
            return _unavailable()
        if path in ("", "/v2") and request.method == "GET":
            return _json({"name": "nimble", "version": __version__, "extensions": ["binary_tensor_data",
                                                                                    "statistics"]})
        if path in ("/health/live", "/health/ready"):
            return _json({})
        if path.startswith("/models/"):
            name = path.split("/")[2]
            return _error(404, f"unknown model '{name[:100]}'; this server has {', '.join(self.models)}")
        return _error(404, f"no route {request.url.path[:200]}")


# ------------------------------------------------------------------------------ the command
@dataclass
class Options:
    host: str = "127.0.0.1"
    port: int = 8000
    replicas: str = "auto"  # a number, or auto: one per visible GPU, else one on the CPU
    delay_ms: float = 2.0
    max_queue: int = 256
    max_ongoing: int = 0  # per replica; 0: twice the largest batch size, at least 16
    address: str | None = None
    device: str = "auto"
    tune: str = "cached"
    max_body: int = 64 * 2**20
    metrics_port: int = 8080
    ingress: str = "haproxy"  # or "proxy": Ray Serve's own HTTP proxy
    body_timeout_s: float = 5.0  # a body's deadline, plus BODY_SECONDS_PER_MIB per MiB
    drain_s: float = 30.0  # how long a stop waits for the requests in flight
    folder: Path | None = None  # the server's private folder (ingress.private_folder); start makes one
    reaper: object = None  # the process that cleans up after a server killed outright (reaper.start)


def model_names(paths: list[Path]) -> dict[str, Path]:
    """name -> artifact: each artifact's file name without `.nimble`, which must be unique and
    fit in a URL."""
    from ..errors import UsageError

    names: dict[str, Path] = {}
    for p in paths:
        name = p.name.removesuffix(".nimble")
        if not NAME.fullmatch(name):
            raise UsageError(f"{p}: serve names a model by its file name, which must be letters, digits, '_', '.' or "
                             "'-' (64 at most); rename the file")
        if name in names:
            raise UsageError(f"{p} and {names[name]} would both be model '{name}'; rename one")
        names[name] = p
    return names


def start(paths: list[Path], options: Options, say=print) -> dict:
    """Start Ray (or join `options.address`) and Ray Serve, deploy every artifact; returns what
    was started (for the ready line). `say(line)` reports progress."""
    import ray

    from ..errors import UsageError
    from ..formats import read_artifact

    import logging

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its per-app INFO lines; the command says its own
    names = model_names(paths)
    batches = {}
    for name, p in names.items():  # checked here, in one line, before any replica tries
        art = read_artifact(p)
        batches[name] = art.batch_sizes
    for what, port in (("--port", options.port), ("--metrics-port", options.metrics_port if options.address is None
                                                   else None)):
        why = None if port is None else ingress.port_in_use(options.host if what == "--port" else "127.0.0.1", port)
        if why:
            raise UsageError(f"{what} {port}: it cannot be opened on {options.host if what == '--port' else '127.0.0.1'} "
                             f"({why}); another server may hold it, so choose another {what}")
    if options.folder is None:
        options.folder = ingress.private_folder()
        options.reaper = reaper.start(options.folder)
    say("starting Ray" if options.address is None else f"joining the Ray cluster at {options.address}")
    if options.address is None and options.ingress == "haproxy":
        # Ray Serve's HAProxy ingress: HAProxy in front of replicas that serve HTTP themselves,
        # instead of Ray's one Python proxy per node (17 ms per 600 KB request, about 120 requests/s)
        os.environ.update(ingress.haproxy_environment(options.folder, ingress.real_haproxy()))
    if options.address is None:  # (Ray takes no loopback node address: it resolves one to the network's)
        # Ray's processes start ignoring SIGINT: a Ctrl-C reaches the terminal's whole process group,
        # and they must outlive the drain it starts (nimble ends them after it)
        before = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False,
                     _metrics_export_port=options.metrics_port)
        finally:
            signal.signal(signal.SIGINT, before)
    else:
        ray.init(address=options.address, logging_level="ERROR", log_to_driver=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    cpu_only = options.device == "cpu" or gpus == 0
    if options.replicas == "auto":
        replicas = 1 if cpu_only else gpus
    elif options.replicas.isdigit() and int(options.replicas) >= 1:
        replicas = int(options.replicas)
    else:
        raise UsageError(f"--replicas {options.replicas!r}: give a number of replicas, or auto")
    if options.device == "cuda" and gpus == 0:
        raise UsageError("--device cuda, but the Ray cluster has no GPU; use --device cpu or auto")
    threads = 0 if not cpu_only else max(1, (os.cpu_count() or 1) // (replicas * len(names)))
    device = "cpu" if cpu_only else "cuda"
    try:
        serve.start(http_options={"host": options.host, "port": options.port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        for name, p in names.items():
            largest = max(batches[name] or [1])
            say(f"loading {name} on {replicas} {'CPU' if cpu_only else 'GPU'} replica(s)")
            app = Model.options(
                name=name, num_replicas=replicas,
                ray_actor_options={"num_gpus": 0 if cpu_only else 1, "num_cpus": 0},
                max_ongoing_requests=options.max_ongoing or max(16, 2 * largest),
                max_queued_requests=options.max_queue,
            ).bind(str(p.resolve()), name, device, options.tune, options.delay_ms / 1e3, options.max_body, threads,
                   str(options.folder), options.body_timeout_s)
            serve.run(app, name=name, route_prefix=f"/v2/models/{name}")
        serve.run(Server.bind(list(names), str(options.folder)), name="nimble", route_prefix="/v2")
    except NimbleError:
        raise
    except Exception as e:  # Ray's own failures (a task's error wraps its cause): one line, with what to try
        raise ExecutionError(start_failure(e, options)) from None
    return {"url": f"http://{options.host}:{options.port}/v2", "models": {n: batches[n] for n in names},
            "replicas": replicas, "device": device,
            "metrics": None if options.address else f"http://127.0.0.1:{options.metrics_port}/metrics",
            "replicas_total": replicas * len(names)}


def start_failure(e: BaseException, options: Options) -> str:
    """The one line for a failure inside Ray Serve's start: the innermost cause a Ray task error
    carries, and what to try (for the HAProxy ingress, Ray's own proxy)."""
    while getattr(e, "cause", None) is not None and e.cause is not e:
        e = e.cause
    text = first_line(e)[:300].strip()
    alerts = [line.split("]", 1)[-1].strip() for log in sorted(Path(options.folder).glob("*.stderr.log"))
              for line in log.read_text(errors="replace").splitlines() if "[ALERT]" in line] \
        if options.folder is not None else []
    if alerts:  # HAProxy's own words (a port in use, say), not its version banner
        text = f"HAProxy: {alerts[-1][:300]}"
    advice = "serve with --ingress proxy (Ray Serve's own HTTP proxy), or try again" \
        if "haproxy" in f"{type(e).__name__} {e}".lower() and options.ingress == "haproxy" \
        else "check the Ray logs (/tmp/ray/session_latest/logs) and try again"
    return f"Ray Serve did not start the models ({type(e).__name__}: {text}); {advice}"


def stop(paths: list[Path], joined: bool, options: Options, replicas: int = 0) -> None:
    """Drain, then take everything down. First readiness goes false and new requests get 503 with
    Retry-After, while the `replicas` replicas finish what they hold (up to `options.drain_s`);
    then HAProxy stops listening; on a cluster this joined, the applications are deleted; a local
    Ray shuts down whole, and the HAProxy processes Ray started under this one end. (On Ray 2.60,
    serve.shutdown waited 30 s for its controller on every stop, and deleting the applications of
    a drained local server took 20 s, for nothing.)"""
    import shutil

    import ray

    names = ["nimble", *model_names(paths)]
    folder = options.folder
    left = _haproxy_below(os.getpid())
    if ray.is_initialized():
        if folder is not None and replicas:
            (folder / ingress.DRAIN_FLAG).touch()
            deadline = time.time() + options.drain_s
            while time.time() < deadline and ingress.idle_count(folder) < replicas:
                time.sleep(0.05)
        left |= _haproxy_below(os.getpid())
        for pid in left:  # soft stop: HAProxy closes its listeners and finishes what it holds
            _signal(pid, signal.SIGUSR1)
        if joined:  # the cluster stays: take the applications off it (a local Ray ends whole, below)
            for name in names:
                try:
                    serve.delete(name, _blocking=False)
                except Exception:  # never deployed: the start failed before it
                    pass
            deadline = time.time() + 20.0
            while time.time() < deadline and set(names) & set(serve.status().applications):
                time.sleep(0.2)
    if not joined:
        left |= _haproxy_below(os.getpid())
        ray.shutdown()
        for pid in left:
            _signal(pid, signal.SIGTERM)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    if options.reaper is not None:  # it ends whatever of this server is left, now or if this dies first
        options.reaper.stdin.close()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _haproxy_below(root: int) -> set[int]:
    """The HAProxy processes among `root`'s descendants (Linux /proc; empty elsewhere)."""
    return {pid for pid, (name, _) in reaper.descendants(root).items() if name == "haproxy"}


def wait_for_signal() -> str:
    """Block until SIGINT or SIGTERM; returns its name."""
    got: list[str] = []

    def handler(signum, frame):
        got.append(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not got:
            time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return got[0]
