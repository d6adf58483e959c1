"""`nimble serve`'s Ray Serve deployments: one application per artifact at /v2/models/<name>, one
at /v2 for the server's own routes (`lifecycle.py` starts and stops them).

Each model is a deployment of `replicas` replicas; each replica loads the artifact once (a
`Replica`) and holds one GPU (`num_gpus=1`; Ray sets CUDA_VISIBLE_DEVICES) or, where there is
none, runs on the CPU. A request that finds its replica idle runs at once; the others are batched
by Ray Serve's `serve.batch`, counted in rows, up to the artifact's largest batch size or until
`delay` passes. A replica takes at most
`max_ongoing` requests at once; beyond them up to `max_queue` wait in Ray's queue, and the rest are
answered 503 at once, with Retry-After (`lifecycle.backpressure`). Ray replaces a replica that
dies; the requests it held get errors.

Routes (the KServe v2 protocol, and Triton's statistics extension):
    GET  /v2                           server metadata
    GET  /v2/health/live, /ready       200 once up
    GET  /v2/models/<name>[/versions/1]           model metadata
    GET  /v2/models/<name>[/versions/1]/ready     200 when a replica has loaded it
    POST /v2/models/<name>[/versions/1]/infer     inference (JSON, and the binary data extension)
    GET  /v2/models/<name>[/versions/1]/stats     the answering replica's statistics
    POST /v2/repository/index          the models and their states (the repository extension)
    POST /v2/repository/models/<name>/load, /unload   400: this server's models are fixed at start
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
from pathlib import Path

from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from .. import __version__
from . import grpc_protocol, ingress
from .loopback import replica_grpc_on_loopback
from .protocol import HEADER_LENGTH, InferRequest, ProtocolError, decode, encode, error_body
from .replica import Replica

EXTENSIONS = ["binary_tensor_data", "statistics", "model_repository"]
MODEL_ROUTE = re.compile(r"^(?:/versions/1)?(/ready|/infer|/stats)?/?$")


def _json(doc, status: int = 200) -> Response:
    return Response(json.dumps(doc).encode(), status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return Response(error_body(message), status_code=status, media_type="application/json")


def _unavailable() -> Response:
    """What a draining server answers a new request: try again (elsewhere) in a second."""
    return Response(error_body("the server is shutting down; send the request again (to another server)"),
                    status_code=503, media_type="application/json", headers={"Retry-After": "1"})


INDEX_BODY = 4096  # a repository index request's body: {} or {"ready": true}
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


# the drain (`stop`) already waited for the requests in flight: Ray's own wait after it need not be long;
# and a replica writes no access-log line per request (Ray's default, INFO, formatted one into a rotating
# file for every request: about 4 % of a replica's time under load)
SHUTDOWN = {"graceful_shutdown_timeout_s": 5.0, "graceful_shutdown_wait_loop_s": 0.2,
            "logging_config": {"log_level": "WARNING", "enable_access_log": False}}


@serve.deployment(**SHUTDOWN)
class Model:
    """One artifact behind /v2/models/<name>."""

    def __init__(self, path: str, name: str, device: str, tune: str, delay_s: float, max_body: int, threads: int,
                 folder: str, body_timeout_s: float, kernels: str | None = None, models: tuple = (), timeline=None):
        replica_grpc_on_loopback()
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
        self._busy_ms = metrics.Counter("nimble_device_busy_ms", "GPU time of the replica's calls, ms", tags)
        self._tags = {"model": name}
        self.replica = Replica(path, name, device, tune, observe=self._observe, kernels=kernels, timeline=timeline)
        self.info = self.replica.info
        self._max_body = max_body
        self.infer_batch.set_max_batch_size(self.info.max_batch)
        self.infer_batch.set_batch_wait_timeout_s(delay_s)
        self._busy = 0  # requests this replica is running or batching (one event loop: no lock needed)
        self._held = 0  # requests this replica answers now, their bodies still arriving included
        self._folder, self._body_timeout_s = folder, body_timeout_s
        self._models = list(models) or [name]  # every model of the server, for the repository index
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

    def _observe(self, rows: int, queue_s: float, compute_s: float, device_s: float | None) -> None:
        self._rows.observe(rows, self._tags)
        self._queue.observe(queue_s * 1e3, self._tags)
        self._gpu.observe(compute_s * 1e3, self._tags)
        if device_s is not None:
            self._busy_ms.inc(device_s * 1e3, self._tags)

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
        arrived = time.perf_counter()
        body = await _body_within(request, self._max_body, self._body_timeout_s)
        decoded = decode(body, request.headers.get(HEADER_LENGTH.lower()), self.info)
        decoded.arrived = arrived
        content, headers = encode(self.info, decoded, await self._answer(decoded))
        self.replica.answered(decoded)
        return Response(content, headers=headers)

    async def _answer(self, decoded: InferRequest) -> list:
        """The outputs of one decoded request (ProtocolError if it cannot run)."""
        decoded.received = time.perf_counter()
        self._busy += 1
        try:  # a request that finds the replica idle runs at once: waiting could batch it with nothing
            answer = (await asyncio.to_thread(self.replica.infer, [decoded]))[0] if self._busy == 1 else \
                await self.infer_batch(decoded)
        finally:
            self._busy -= 1
        if isinstance(answer, ProtocolError):
            raise answer
        return answer

    # The KServe v2 gRPC methods (grpc_protocol.METHODS), which Ray Serve calls by name. The ingress
    # routes a request naming a model to that model's replicas, and the others (the server's
    # health and metadata, the repository index, an unknown model) to the first model's.

    async def ModelInfer(self, request, grpc_context=None):
        arrived = time.perf_counter()

        async def infer():
            decoded = grpc_protocol.decode(request, self.info)
            decoded.arrived = arrived
            message = grpc_protocol.encode(self.info, decoded, await self._answer(decoded))
            self.replica.answered(decoded)
            return message
        return await self._grpc(grpc_context, "ModelInferResponse", infer, model=request.model_name, serving=True)

    async def ModelMetadata(self, request, grpc_context=None):
        return await self._grpc(grpc_context, "ModelMetadataResponse", lambda: grpc_protocol.metadata(self.info),
                                model=request.name)

    async def ModelReady(self, request, grpc_context=None):
        return await self._grpc(grpc_context, "ModelReadyResponse", lambda: grpc_protocol.M["ModelReadyResponse"](
            ready=not ingress.draining(self._folder)), model=request.name)

    async def ModelStatistics(self, request, grpc_context=None):
        return await self._grpc(grpc_context, "ModelStatisticsResponse", lambda: grpc_protocol.statistics(
            self.replica.stats.document(self.info.name)), model=request.name)

    async def ServerLive(self, request, grpc_context=None):
        return grpc_protocol.M["ServerLiveResponse"](live=True)

    async def ServerReady(self, request, grpc_context=None):
        return grpc_protocol.M["ServerReadyResponse"](ready=not ingress.draining(self._folder))

    async def ServerMetadata(self, request, grpc_context=None):
        return grpc_protocol.M["ServerMetadataResponse"](name="nimble", version=__version__, extensions=EXTENSIONS)

    async def RepositoryIndex(self, request, grpc_context=None):
        async def answer():
            if request.repository_name:
                raise ProtocolError(404, f"there is no repository '{request.repository_name[:100]}'; leave "
                                    "repository_name empty: this server has one")
            rows = await asyncio.to_thread(index, self._models, request.ready)
            return grpc_protocol.M["RepositoryIndexResponse"](models=[grpc_protocol.M["ModelIndex"](**r) for r in rows])
        return await self._grpc(grpc_context, "RepositoryIndexResponse", answer)

    def _known(self, name: str) -> None:
        if name != self.info.name:
            known = ", ".join(self._models)
            raise ProtocolError(404, f"unknown model '{name[:100]}'; this server has {known}" if name else
                                f"the request names no model; this server has {known}")

    async def _grpc(self, context, response: str, answer, model: str | None = None, serving: bool = False):
        """`answer()`'s message (awaited where it is a coroutine), for the request naming `model`
        where given; or the empty `response` with the gRPC status of its error (one line)."""
        if serving and ingress.draining(self._folder):
            error = ProtocolError(503, "the server is shutting down; send the request again (to another server)")
        else:
            self._held += 1
            try:
                if model is not None:
                    self._known(model)
                message = answer()
                return await message if inspect.isawaitable(message) else message
            except ProtocolError as e:
                error = e
            except Exception as e:  # a fault of nimble's: one line for the client, the traceback in the replica's log
                import logging

                logging.getLogger("ray.serve").exception("nimble serve: gRPC %s failed", response)
                error = ProtocolError(500, f"internal error ({type(e).__name__}); the replica's log has the traceback")
            finally:
                self._held -= 1
        if context is not None:
            context.set_code(grpc_protocol.CODES.get(error.status, grpc_protocol.CODES[500]))
            context.set_details(str(error))
        return grpc_protocol.M[response]()


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, **SHUTDOWN)
class Server:
    """The server's own routes under /v2, and a JSON 404 for an unknown model."""

    def __init__(self, models: list[str], folder: str):
        replica_grpc_on_loopback()
        self.models, self._folder = models, folder

    async def __call__(self, request: Request) -> Response:
        prefix = request.scope.get("root_path", "")
        path = request.url.path[len(prefix):].rstrip("/") if request.url.path.startswith(prefix) else ""
        if path == "/health/ready" and ingress.draining(self._folder):
            return _unavailable()
        if path in ("", "/v2") and request.method == "GET":
            return _json({"name": "nimble", "version": __version__, "extensions": EXTENSIONS})
        if path in ("/health/live", "/health/ready"):
            return _json({})
        if path.startswith("/repository/"):
            return await self._repository(request, path)
        if path.startswith("/models/"):
            name = path.split("/")[2]
            return _error(404, f"unknown model '{name[:100]}'; this server has {', '.join(self.models)}")
        return _error(404, f"no route {request.url.path[:200]}")

    async def _repository(self, request: Request, path: str) -> Response:
        """The repository extension: the index of the models with their states; load and unload
        are refused, since the models are the ones `nimble serve` was started with."""
        if request.method != "POST":
            return _error(405, f"{request.url.path[:200]} takes POST")
        try:
            body = await _body_within(request, INDEX_BODY, 5.0)
            doc = json.loads(body) if body.strip() else {}
        except ProtocolError as e:
            return _error(e.status, str(e))
        except ValueError:
            return _error(400, "the request body is not JSON; send {} or {\"ready\": true}")
        if not isinstance(doc, dict) or not isinstance(doc.get("ready", False), bool):
            return _error(400, "the request body must be a JSON object whose \"ready\", if given, is true or false")
        if path == "/repository/index":
            return _json(index(self.models, doc.get("ready", False)))
        action = re.fullmatch(r"/repository/models/([^/]+)/(load|unload)", path)
        if action is None:
            return _error(404, f"no route {request.url.path[:200]}; the repository routes are POST "
                          "/v2/repository/index and /v2/repository/models/<name>/load or /unload")
        name, verb = action.groups()
        known = "" if name in self.models else f"there is no model '{name[:100]}', and "
        return _error(400, f"{known}this server's models are fixed when it starts ({', '.join(self.models)}), so it "
                      f"does not {verb} models; start nimble serve again with the artifacts (or folder) you want")


def index(models: list[str], ready_only: bool) -> list[dict]:
    """Each model with its state: READY where its application runs, else LOADING or UNAVAILABLE
    (with Ray Serve's reason); `ready_only` keeps the READY ones."""
    try:
        apps = serve.status().applications
    except Exception as e:  # the controller did not answer: say so per model rather than guess
        apps, why = {}, f"Ray Serve's status is unavailable ({type(e).__name__})"
    else:
        why = "not deployed"
    rows = []
    for name in models:
        app = apps.get(name)
        status = str(getattr(app, "status", "")).rsplit(".", 1)[-1]
        state = {"RUNNING": "READY", "DEPLOYING": "LOADING", "NOT_STARTED": "LOADING"}.get(status, "UNAVAILABLE")
        row = {"name": name, "version": "1", "state": state}
        if state == "UNAVAILABLE":
            row["reason"] = (getattr(app, "message", "") or status.lower() or why)[:200]
        if state == "READY" or not ready_only:
            rows.append(row)
    return rows
