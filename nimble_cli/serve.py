"""`nimble serve`: artifacts behind the KServe v2 inference protocol, on Ray Serve."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from .common import DebugOption, DeviceOption, TuneOption, check_pack, console, early_checks, literal, user_errors


def serve_command(
    artifacts: list[Path] = typer.Argument(..., metavar="ARTIFACT|FOLDER...", help="One or more .nimble artifacts, "
                                           "or folders of them (a model repository: every .nimble file directly "
                                           "inside); each is served as the model named by its file name "
                                           "(resnet50.nimble: /v2/models/resnet50), with a queue and batcher of "
                                           "its own."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface). HAProxy's "
                             "stats and metrics stay on 127.0.0.1; Ray's own services and its metrics port listen on "
                             "every interface (Ray binds them so): firewall them on a shared network."),
    port: int = typer.Option(8000, "--port", help="HTTP port."),
    grpc_port: int = typer.Option(8001, "--grpc-port", help="Port of the KServe v2 gRPC service (Triton's "
                                  "inference.GRPCInferenceService, e.g. for tritonclient.grpc), on --host beside "
                                  "HTTP; 0: none. Served by the haproxy ingress of a local Ray only."),
    replicas: str = typer.Option("auto", "--replicas", metavar="N|auto", help="Replicas per model, each loading "
                                 "the artifact once and holding one GPU (or its share, --replicas-per-gpu); auto: "
                                 "--replicas-per-gpu on each GPU the Ray cluster has, or one on the CPU where it "
                                 "has none."),
    per_gpu: int = typer.Option(1, "--replicas-per-gpu", metavar="N", help="Replicas that share one GPU, each a "
                                "process with its own copy of the model: a replica's request path, not the GPU, "
                                "limits what it serves, so more of them serve more (8 on one H200 served 6.8 times "
                                "one's resnet50 requests: docs/serve.md), at some latency when idle."),
    delay_ms: float = typer.Option(2.0, "--max-batch-delay-ms", metavar="MS", help="How long a request may wait "
                                   "for others to batch with, up to the artifact's largest batch size "
                                   "(compile --batch-sizes)."),
    max_queue: int = typer.Option(256, "--max-queue", metavar="N", help="Requests that may wait per model "
                                  "beyond those the replicas hold; more are answered 503 at once, with "
                                  "Retry-After: 1."),
    max_ongoing: int = typer.Option(0, "--max-ongoing", metavar="N", help="Requests one replica holds at once "
                                    "(being batched or run); 0: twice the largest batch size, at least 16."),
    max_body: int = typer.Option(64 * 2**20, "--max-body", metavar="BYTES", help="Largest request body; a larger "
                                 "one is answered 413."),
    address: str = typer.Option(None, "--address", metavar="RAY_ADDRESS", help="Join this Ray cluster (e.g. "
                                "auto, or ray://head:10001) instead of starting a local one: the replicas then "
                                "spread over its machines and GPUs. The cluster's own listeners are then its "
                                "business: Ray's nodes talk over the network, and each replica serves HTTP on its "
                                "node's address, so run it on a network you trust."),
    ingress: str = typer.Option("haproxy", "--ingress", metavar="haproxy|proxy", help="What takes the "
                                "requests on a local Ray: haproxy (Ray Serve's HAProxy ingress, in front of replicas "
                                "that serve HTTP and gRPC themselves) or proxy (Ray Serve's Python HTTP proxy, one "
                                "per node: about 17 ms per 600 KB request; no gRPC). A cluster (--address) uses "
                                "what it was started with, and gets no gRPC from nimble."),
    metrics_port: int = typer.Option(8080, "--metrics-port", help="Where a local Ray exports Prometheus metrics "
                                     "(Ray Serve's, and nimble_batch_rows, nimble_queue_ms, nimble_compute_ms, and "
                                     "on a GPU nimble_device_busy_ms), on every interface."),
    body_timeout: float = typer.Option(5.0, "--body-timeout", metavar="SECONDS", help="How long a request body may "
                                       "take to arrive, plus 2 s per MiB it declares (60 s at most); a slower one "
                                       "is answered 408 and its slot freed."),
    drain_timeout: float = typer.Option(30.0, "--drain-timeout", metavar="SECONDS", help="On Ctrl-C or SIGTERM, "
                                        "how long the requests in flight may take to finish; new ones get 503 with "
                                        "Retry-After meanwhile."),
    kernels: list[Path] = typer.Option(None, "--kernels", metavar="PACK", help="A kernel pack you trust for each "
                                       "ARTIFACT, in the same order (`nimble compile --gpu-arch` writes "
                                       "MODEL.nimble.kernels): each replica takes its prebuilt kernels instead of "
                                       "building them as it loads. Naming a pack trusts its machine code as you "
                                       "trust a program you run; a pack for another GPU, Triton or nimble is not "
                                       "used (one line in the replica's log says why). With NIMBLE_KERNEL_KEY set, "
                                       "the signed pack beside each artifact is used without --kernels."),
    timeline: Path = typer.Option(None, "--timeline", metavar="DIR", help="For profiling: each replica writes a "
                                  "line per call to DIR/replica-PID.jsonl (when its first request arrived, when "
                                  "the call ran on the host and, on a GPU, there, from CUDA events; its rows) and "
                                  "one per request (taken, decoded, its call, encoded). benchmarks/serve_scaling.py "
                                  "reads them: how busy the GPUs were, where a request's time went. A local Ray "
                                  "only."),
    device: DeviceOption = "auto",
    tune: TuneOption = "cached",
    debug: DebugOption = False,
) -> None:
    """Serve artifacts over HTTP and gRPC with the KServe v2 protocol (as Triton Inference Server does).

    Requests are batched dynamically into the artifact's batch sizes. Clients that speak the
    protocol work unchanged, e.g. tritonclient.http and tritonclient.grpc. Stop with Ctrl-C or SIGTERM: the requests in
    flight finish first. Needs the serve extra: pip install 'nimble-gpu[serve]'.

    Examples: nimble compile resnet50.pt -s 1x3x224x224 --batch-sizes 1,2,4,8,16, then
    nimble serve resnet50.nimble; curl localhost:8000/v2/models/resnet50. A folder of
    artifacts: nimble serve models/; curl -X POST localhost:8000/v2/repository/index lists them.
    """
    with user_errors(debug):
        from nimble.errors import UsageError
        from nimble.model_files import check_artifact_file, repository

        early_checks(device=device, tune=tune)
        if kernels and any(p.is_dir() for p in artifacts):
            raise UsageError("--kernels names a pack per artifact, which a folder's artifacts cannot be matched to; "
                             "pass the artifacts one by one, or put each one's signed pack beside it "
                             "(MODEL.nimble.kernels, nimble compile --gpu-arch --sign-with)")
        artifacts = repository(artifacts)
        for p in artifacts:
            check_artifact_file(p)
        if kernels and len(kernels) != len(artifacts):
            raise UsageError(f"--kernels: give one pack per ARTIFACT, in the same order ({len(artifacts)} artifact(s), "
                             f"{len(kernels)} pack(s))")
        for pack in kernels or []:
            check_pack(pack)
        if not 1 <= port <= 65535 or not 1 <= metrics_port <= 65535 or not 0 <= grpc_port <= 65535:
            raise UsageError("--port and --metrics-port take a TCP port from 1 to 65535, --grpc-port one from 0 "
                             "(none) to 65535")
        if grpc_port and grpc_port in (port, metrics_port):
            raise UsageError(f"--grpc-port {grpc_port} is also --port or --metrics-port; give each its own port")
        if ingress not in ("haproxy", "proxy"):
            raise UsageError(f"--ingress {ingress!r}: use haproxy or proxy")
        if not 1 <= per_gpu <= 16:
            raise UsageError(f"--replicas-per-gpu {per_gpu}: give 1 to 16 replicas per GPU")
        if delay_ms < 0 or max_queue < 1 or max_ongoing < 0 or max_body < 1:
            raise UsageError("--max-batch-delay-ms must not be negative; --max-queue and --max-body must be positive")
        if not (0 < body_timeout <= 600 and 0 <= drain_timeout <= 3600):
            raise UsageError("--body-timeout takes seconds from above 0 to 600, --drain-timeout from 0 to 3600")
        if timeline is not None:
            if address is not None:
                raise UsageError("--timeline needs the replicas on this machine: leave out --address")
            try:
                timeline.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UsageError(f"--timeline {timeline}: cannot make the folder ({e.strerror}); name a folder you "
                                 "can write") from None
            if not os.access(timeline, os.W_OK | os.X_OK):
                raise UsageError(f"--timeline {timeline}: the folder is not writable; name a folder you can write")
        if address is None:  # before Ray is imported: the Ray it starts listens on loopback only
            from nimble.serve.ingress import keep_local_ray_on_loopback

            keep_local_ray_on_loopback()
        try:
            from nimble.serve import lifecycle as app
        except ImportError as e:
            raise UsageError(f"nimble serve needs Ray Serve ({e.name or e} is not installed): "
                             "pip install 'nimble-gpu[serve]'") from None

        def say(line: str) -> None:
            console.print(f"... {line}")

        options = app.Options(host=host, port=port, grpc_port=grpc_port, replicas=replicas, per_gpu=per_gpu,
                              delay_ms=delay_ms, max_queue=max_queue, max_ongoing=max_ongoing, address=address,
                              device=device, tune=tune,
                              max_body=max_body, metrics_port=metrics_port, ingress=ingress,
                              body_timeout_s=body_timeout, drain_s=drain_timeout,
                              kernels=tuple(str(k.resolve()) for k in kernels or ()),
                              timeline=timeline.resolve() if timeline is not None else None)
        started = None
        try:
            started = app.start(artifacts, options, say)
            models = ", ".join(f"{literal(n)} (batch sizes {','.join(map(str, b)) or 'fixed'})"
                               for n, b in started["models"].items())
            metrics = f"; metrics at {started['metrics']}" if started["metrics"] else ""
            grpc = f" and gRPC at {started['grpc']}" if started["grpc"] else ""
            console.print(f"nimble serve: ready at {started['url']}{grpc}: {models}; {started['replicas']} replica(s) per "
                          f"model on {started['device']}{metrics}. Ctrl-C stops.")
            name = app.wait_for_signal()
            console.print(f"{name}: shutting down: new requests get 503, the requests in flight finish")
        finally:
            if started is not None or address is None:
                app.stop(artifacts, address is not None, options, started["replicas_total"] if started else 0)
        console.print("stopped")
