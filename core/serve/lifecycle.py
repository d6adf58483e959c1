"""`nimble serve`'s lifecycle: check the artifacts, start Ray (or join a cluster) and deploy them
(`app.py`), say ready, wait for a signal, then drain and leave nothing behind (`ingress.py`,
`reaper.py`)."""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ray import serve

from ..errors import ExecutionError, NimbleError, first_line
from . import grpc_protocol, ingress, reaper
from .app import Model, Server

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass
class Options:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 8001  # the KServe v2 gRPC service, through the HAProxy ingress; 0: none
    replicas: str = "auto"  # a number, or auto: per_gpu per visible GPU, else one on the CPU
    per_gpu: int = 1  # replicas that share one GPU (each takes 1/per_gpu of it in Ray's count)
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
    kernels: tuple = ()  # a trusted kernel pack's path per artifact, in their order (or none)
    timeline: Path | None = None  # a folder where each replica writes its calls' timeline (timeline.py)


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
    grpc = grpc_served(options)
    if options.grpc_port and not grpc:
        say("no gRPC: it is served through the haproxy ingress of a local Ray only (--ingress haproxy, no --address)")
    wanted = [("--port", options.host, options.port)]  # a local Ray's metrics bind every interface
    wanted += [("--grpc-port", options.host, options.grpc_port)] if grpc else []
    wanted += [("--metrics-port", "0.0.0.0", options.metrics_port)] if options.address is None else []
    for what, host, port in wanted:
        if why := ingress.port_in_use(host, port):
            raise UsageError(f"{what} {port}: it cannot be opened on {host} ({why}); another server may hold it, so "
                             f"choose another {what}")
    if options.folder is None:
        options.folder = ingress.private_folder()
        options.reaper = reaper.start(options.folder)
    say("starting Ray" if options.address is None else f"joining the Ray cluster at {options.address}")
    if options.address is None and options.ingress == "haproxy":
        # Ray Serve's HAProxy ingress: HAProxy in front of replicas that serve HTTP themselves,
        # instead of Ray's one Python proxy per node (17 ms per 600 KB request, about 120 requests/s)
        os.environ.update(ingress.haproxy_environment(options.folder, ingress.real_haproxy(), list(names),
                                                     [port for _, _, port in wanted]))
    if grpc:  # a gRPC request is parsed whole before it is checked: never more than --max-body bytes
        os.environ["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] = str(options.max_body)
    if options.address is None:  # a Ray of its own, on loopback: every listener on 127.0.0.1 (ingress.LOOPBACK_RAY)
        # Ray's processes start ignoring SIGINT: a Ctrl-C reaches the terminal's whole process group,
        # and they must outlive the drain it starts (nimble ends them after it)
        before = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            # Ray's own folder (its sockets and logs) inside the private one: /tmp/ray is world-writable
            ingress.keep_local_ray_on_loopback()  # for the processes Ray starts; the driver's is checked below
            ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False, _node_ip_address="127.0.0.1",
                     _metrics_export_port=options.metrics_port, _temp_dir=str(options.folder / "ray"),
                     runtime_env={"worker_process_setup_hook": "nimble.serve.loopback.replica_grpc_on_loopback"})
        finally:
            signal.signal(signal.SIGINT, before)
        if ray.util.get_node_ip_address() != "127.0.0.1":  # Ray was imported before nimble could set it
            ray.shutdown()
            raise ExecutionError("Ray took this machine's network address for its node, so its servers would listen "
                                 "beyond loopback; start `nimble serve` in a process of its own (it sets "
                                 f"{', '.join(f'{k}={v}' for k, v in ingress.LOOPBACK_RAY.items())} before Ray "
                                 "is imported), or join a cluster of your own with --address")
    else:
        ray.init(address=options.address, logging_level="ERROR", log_to_driver=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    cpu_only = options.device == "cpu" or gpus == 0
    if options.replicas == "auto":
        replicas = 1 if cpu_only else gpus * options.per_gpu
    elif options.replicas.isdigit() and int(options.replicas) >= 1:
        replicas = int(options.replicas)
    else:
        raise UsageError(f"--replicas {options.replicas!r}: give a number of replicas, or auto")
    if options.device == "cuda" and gpus == 0:
        raise UsageError("--device cuda, but the Ray cluster has no GPU; use --device cpu or auto")
    threads = 0 if not cpu_only else max(1, (os.cpu_count() or 1) // (replicas * len(names)))
    device = "cpu" if cpu_only else "cuda"
    try:
        grpc_options = {"port": options.grpc_port, "grpc_servicer_functions": [grpc_protocol.SERVICER],
                        "enable_reflection": False} if grpc else None
        serve.start(http_options={"host": options.host, "port": options.port}, grpc_options=grpc_options,
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        packs = dict(zip(names, options.kernels))
        for name, p in names.items():
            largest = max(batches[name] or [1])
            say(f"loading {name} on {replicas} {'CPU' if cpu_only else 'GPU'} replica(s)")
            app = Model.options(
                name=name, num_replicas=replicas,
                ray_actor_options={"num_gpus": 0 if cpu_only else 1 / options.per_gpu, "num_cpus": 0},
                max_ongoing_requests=options.max_ongoing or max(16, 2 * largest),
                max_queued_requests=options.max_queue,
                **backpressure(),
            ).bind(str(p.resolve()), name, device, options.tune, options.delay_ms / 1e3, options.max_body, threads,
                   str(options.folder), options.body_timeout_s, packs.get(name), tuple(names),
                   str(options.timeline) if options.timeline else None)
            serve.run(app, name=name, route_prefix=f"/v2/models/{name}")
        serve.run(Server.bind(list(names), str(options.folder)), name="nimble", route_prefix="/v2")
    except NimbleError:
        raise
    except Exception as e:  # Ray's own failures (a task's error wraps its cause): one line, with what to try
        raise ExecutionError(start_failure(e, options)) from None
    return {"url": f"http://{options.host}:{options.port}/v2", "models": {n: batches[n] for n in names},
            "grpc": f"{options.host}:{options.grpc_port}" if grpc else None,
            "replicas": replicas, "device": device,
            "metrics": None if options.address else f"http://127.0.0.1:{options.metrics_port}/metrics",
            "replicas_total": replicas * len(names)}


def grpc_served(options: Options) -> bool:
    """Whether the server takes gRPC: on the HAProxy ingress of a local Ray, which routes each
    request to its model's replicas and listens on --host only. (Ray's Python proxy routes gRPC by
    an `application` header that the protocol's clients do not send, and listens on every
    interface; a cluster's ingress is the cluster's.)"""
    return bool(options.grpc_port) and options.ingress == "haproxy" and options.address is None


RETRY_AFTER_S = 1  # what a 503 past the queue bound tells the client to wait


def backpressure() -> dict:
    """Deployment options that make Ray Serve's 503 past `max_queued_requests` say Retry-After
    (its `BackpressureConfig`, Ray 2.60 on); none on a Ray without it, whose 503 then says nothing."""
    try:
        from ray.serve.config import BackpressureConfig
    except ImportError:
        return {}
    return {"backpressure_config": BackpressureConfig(retry_after_s=RETRY_AFTER_S)}


def start_failure(e: BaseException, options: Options) -> str:
    """The one line for a failure inside Ray Serve's start: the innermost cause a Ray task error
    carries, and what to try (for the HAProxy ingress, Ray's own proxy)."""
    while getattr(e, "cause", None) is not None and e.cause is not e:
        e = e.cause
    text = first_line(e)[:300].strip()
    logs = [log.read_text(errors="replace") for log in sorted(Path(options.folder).glob("*.stderr.log"))] \
        if options.folder is not None else []
    # HAProxy's lines come in Ray's message (the tail of its stderr, first a version banner) or its logs
    alerts = [re.sub(r"^\s*\(\d+\)\s*:", "", line.split("[ALERT]", 1)[1]).strip()
              for text in [str(e), *logs] for line in text.splitlines() if "[ALERT]" in line]
    if alerts:  # HAProxy's own words (a port in use, say), not its version banner
        text = f"HAProxy: {alerts[-1][:300]}"
    advice = "serve with --ingress proxy (Ray Serve's own HTTP proxy), or try again" \
        if "haproxy" in f"{type(e).__name__} {e}".lower() and options.ingress == "haproxy" \
        else "run it again with --debug for Ray's traceback"
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
        deadline = time.time() + 5.0  # ... then exits: nothing it answers is cut by Ray's end
        while time.time() < deadline and left & _haproxy_below(os.getpid()):
            time.sleep(0.05)
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
        os.environ.pop(reaper.MARK, None)


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
