"""What `nimble serve` opens on the machine, kept to what the user asked for (no Ray here).

- A private folder (mode 0700) per server: HAProxy's config, admin socket and state live there,
  so that no other user can reach the admin socket, and two servers on one machine never share it.
- HAProxy's own listeners (its stats page and its Prometheus metrics) on loopback, on ports chosen
  free at start, never fixed ones that a leftover could hold. Ray Serve writes HAProxy's config
  itself, binding those on every interface with a world-writable admin socket; nimble points Ray at
  a small wrapper (`RAY_SERVE_HAPROXY_BINARY_PATH`) that edits the config Ray wrote before it
  execs the real binary.
- Short timeouts where a client could hold a connection: the headers and the body's first 16 KiB
  within `HEADER_TIMEOUT_S`, buffered by HAProxy before any replica sees the request (a body that
  drips in never takes a replica's slot), an idle client cut after `CLIENT_TIMEOUT_S`.
- The drain: a flag file in the folder that every replica reads (`draining`), and the file each
  replica keeps there while it holds no request (`idle_marker`). Once it is there, the wrapper
  below starts no HAProxy: Ray Serve restarts an HAProxy that exits, and the stop's soft-stopped
  one exits before Ray does.
- No reuse of HAProxy's connections to the replicas (`http-reuse never`; Ray writes `always`). A
  request sent on a reused connection to a replica that then dies is closed without an answer,
  which HAProxy does so that a browser retries: a client of this server saw "remote end closed
  connection without response" for the requests in flight when a replica was killed
  (`tests/serve/test_server.py`). On a fresh connection the same failure is HAProxy's 502, which
  Ray's config answers as 500. The price is one loopback connect per request.
"""

from __future__ import annotations

import os
import shlex
import socket
import tempfile
from pathlib import Path

HEADER_TIMEOUT_S = 10
CLIENT_TIMEOUT_S = 30
DRAIN_FLAG = "draining"


def private_folder() -> Path:
    """A new folder only this user can enter."""
    return Path(tempfile.mkdtemp(prefix="nimble-serve-"))


# Ray binds its servers (GCS, raylet, workers, object manager, metrics) to its node's address, and
# takes 127.0.0.1 for that address only where it believes it runs on one machine: its Windows and
# macOS default, which this variable sets. Ray reads it when it is first imported, and so does
# every process it starts.
LOOPBACK_RAY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def keep_local_ray_on_loopback() -> None:
    """Make the Ray that `nimble serve` starts listen on loopback only: call before Ray is imported
    (`lifecycle.start` then checks that it took)."""
    os.environ.update(LOOPBACK_RAY)


# Ports that other processes take on their own while a server starts: Ray's workers (10002 to
# 19999), the direct-ingress ports of Ray Serve's replicas (30000 to 31000 for HTTP, 40000 to 41000
# for gRPC), and whatever the kernel hands to a bind of port 0 (its ephemeral range, 32768 to 60999
# by default). A port picked free from those can be taken before HAProxy binds it, seconds later,
# and HAProxy then exits at its start: once in CI's tests. `free_port` picks below all of them.
QUIET_PORTS = range(20000, 30000)
DIRECT_INGRESS = {"HTTP": (30000, 31000), "GRPC": (40000, 41000)}


def _ephemeral_ports() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, from `QUIET_PORTS` less the kernel's ephemeral range (where a
    machine has widened that range over them, one the kernel picks)."""
    import random

    ephemeral = _ephemeral_ports()
    quiet = [p for p in random.sample(QUIET_PORTS, 200) if p not in ephemeral]
    for port in quiet:
        if port_in_use(host, port) is None:
            return port
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def direct_ingress_ports(taken: list[int]) -> dict[str, str]:
    """Ray Serve's direct-ingress port ranges for the replicas, moved (in steps of their width)
    off the ports that HAProxy must bind later (`taken`): a replica that starts first on the
    user's --grpc-port, say, would make HAProxy exit at its start."""
    env = {}
    for kind, (low, high) in DIRECT_INGRESS.items():
        width = high - low
        while any(low <= port <= high for port in taken):
            low, high = low + width + 1, high + width + 1
        env[f"RAY_SERVE_DIRECT_INGRESS_MIN_{kind}_PORT"] = str(low)
        env[f"RAY_SERVE_DIRECT_INGRESS_MAX_{kind}_PORT"] = str(high)
    return env


def port_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound now, or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def refuse_taken_port(address: str) -> None:
    """RuntimeError (from the OSError) where `address` ("host:port", "[::]:port") is held by
    another socket, SO_REUSEPORT ones included: bound without that option, a probe fails where
    any socket holds the port. Port 0 is never taken. Ray Serve tries another port on this error."""
    host, port = address.rsplit(":", 1)
    host = host.strip("[]")
    if port == "0":
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        try:
            probe.bind((host, int(port)))
        except OSError as e:
            raise RuntimeError(f"port {port} is held by another process") from e


def haproxy_environment(folder: Path, real_binary: str, models: list[str] = (),
                        ports: list[int] = ()) -> dict[str, str]:
    """Environment for Ray Serve's HAProxy ingress, confined as the module says, with gRPC
    requests routed by the model they name (`grpc_routes`); `ports` are the ones HAProxy serves
    the models on, which no replica may take first (`direct_ingress_ports`)."""
    stats, metrics = free_port(), free_port()
    wrapper = folder / "haproxy"
    edits = grpc_routes(models) + [
        r"s/^\(\s*stats socket \S*\) mode [0-7]* /\1 mode 600 /",
        rf"s/^\(\s*bind \)\*\{{0,1\}}:\({stats}\|{metrics}\)\s*$/\1127.0.0.1:\2/",
        # the headers, and the body's first buffer (16 KiB), must arrive within HEADER_TIMEOUT_S before
        # HAProxy hands the request to a replica: a slow body holds no replica's slot
        rf"s/^\(\s*\)timeout client \(.*\)$/&\n\1timeout http-request {HEADER_TIMEOUT_S}s\n\1option http-buffer-request/",
        r"s/^\(\s*\)http-reuse always\s*$/\1http-reuse never/",  # every request answered (module docstring)
    ]
    script = "\n".join([
        "#!/bin/sh",
        "# written by nimble serve: the config Ray Serve wrote, confined to loopback, before HAProxy reads it",
        'cfg=""; prev=""',
        'for a in "$@"; do [ "$prev" = "-f" ] && cfg="$a"; prev="$a"; done',
        'if [ -n "$cfg" ] && ! grep -q "^# confined by nimble" "$cfg"; then',
        f'    sed -i {" ".join("-e " + shlex.quote(e) for e in edits)} "$cfg" && echo "# confined by nimble" >> "$cfg"',
        "fi",
        # once the server drains, no HAProxy starts again: Ray Serve restarts one that exits, and the stop's
        # soft-stopped HAProxy exits before Ray does; a new one would answer for models being taken down
        f'if [ -e {shlex.quote(str(folder / DRAIN_FLAG))} ]; then echo "nimble serve is stopping: HAProxy is not '
        'started again" >&2; exit 1; fi',
        f'exec {shlex.quote(real_binary)} "$@"',
        "",
    ])
    wrapper.write_text(script)
    wrapper.chmod(0o700)
    (folder / "state").mkdir(mode=0o700, exist_ok=True)
    return {
        **direct_ingress_ports([*ports, stats, metrics]),
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(wrapper),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(stats),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(folder / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(folder / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(folder / "state"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(folder / "state" / "server-state"),
        "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(CLIENT_TIMEOUT_S),
        # the head node's fallback proxy (Ray's own, for what HAProxy does not route): on ports free now,
        # not Ray's fixed 8500 and 9500, which a second server on the machine would find taken
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
        # Ray waits 30 s for HAProxy to answer on its admin socket, and on a busy 2-core machine
        # (Ray's own processes starting beside other work) that start failed once in CI's tests
        "RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S": os.environ.get("RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S", "120"),
    }


def grpc_routes(models: list[str]) -> list[str]:
    """sed edits of Ray's config that send a gRPC request to the replicas of the model it names.

    Ray Serve routes a gRPC request by its `application` header, which the protocol's clients
    (tritonclient.grpc) never send: with several applications, each unmatched request would get
    NOT_FOUND. Every request of the protocol that concerns one model names it in its message's
    first field, so the body, which HAProxy buffers (`option http-buffer-request`), starts, after
    gRPC's 5-byte frame header, with `grpc_protocol.model_name_prefix`. Each model's backend gains
    a rule on those bytes, and the rest (the server's health and metadata, the repository index,
    an unknown model) go to the first model's replicas, which answer them, or NOT_FOUND."""
    from .grpc_protocol import model_name_prefix

    edits = []
    for name in models:
        prefix, pattern = model_name_prefix(name), name.replace(".", r"\.")  # names: letters, digits, _ . -
        edits.append(rf"s/^\(\s*\)acl is_\(\S*\) req.hdr(application) -m str {pattern}\s*$/&\n"
                     rf"\1acl nimble_model_\2 req.body,bytes(5,{len(prefix)}) -m bin {prefix.hex()}\n"
                     rf"\1use_backend \2 if nimble_model_\2/")
    if models:  # by name at run time (%[...]): before the first model is deployed, its backend does not exist,
        # and HAProxy then takes the default backend where a plain name would not start
        edits.append(rf"/^frontend grpc_frontend/,/^backend /s/^\(\s*\)default_backend default_grpc_backend\s*$/"
                     rf"\1use_backend %[str({grpc_backend(models[0])})]\n&/")
        # ... whose answer to a request without an `application` header, Ray's NOT_FOUND, is then wrong: here
        # it means that no model's backend is in HAProxy's config (the server is starting, or stopping), which
        # a client should retry: UNAVAILABLE
        edits.append(r's/^\(\s*http-request return status 200 content-type application\/grpc hdr grpc-status \)5'
                     r'\( hdr grpc-message \)"Application metadata not set[^"]*"\s*$/\114\2"no model is served now '
                     r'(the server is starting or stopping); send the request again"/')
        # and a model whose replicas HAProxy sees down (a drain) falls back to Ray's Python proxy, which routes
        # gRPC by the header tritonclient never sends, and so answered NOT_FOUND ("Application metadata not
        # set"): the gRPC backends lose that fallback, and such a request gets HAProxy's 503, UNAVAILABLE
        edits.append(r"/^\s*server \S* \S* proto h2 check backup\s*$/d")
        # with no replica up, HAProxy's own 503 (which Ray's config serves as a 500) reaches a gRPC client as
        # UNKNOWN: each gRPC backend answers UNAVAILABLE itself then
        edits.append(r'/^backend grpc-/{n;s/^\(\s*\)mode http\s*$/&\n\1http-request return status 200 content-type '
                     r'application\/grpc hdr grpc-status 14 hdr grpc-message "no replica of this model is up now; send '
                     r'the request again" if { nbsrv lt 1 }/}')
    return edits


def grpc_backend(app: str) -> str:
    """The name Ray Serve's HAProxy config gives the gRPC backend of application `app`."""
    from ray.serve._private.haproxy import HAProxyManager

    return HAProxyManager.get_safe_name(f"grpc-{app}")


def real_haproxy() -> str:
    """The HAProxy binary Ray Serve would run (its bundled one, else the system's)."""
    from ray.serve._private.haproxy import get_haproxy_binary

    return get_haproxy_binary()


def draining(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, DRAIN_FLAG))


def idle_marker(folder: str, who: str) -> str:
    return os.path.join(folder, f"idle.{who}")


def idle_count(folder: Path) -> int:
    return len(list(folder.glob("idle.*")))
