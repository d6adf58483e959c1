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
  replica keeps there while it holds no request (`idle_marker`).
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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound now, or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def haproxy_environment(folder: Path, real_binary: str) -> dict[str, str]:
    """Environment for Ray Serve's HAProxy ingress, confined as the module says."""
    stats, metrics = free_port(), free_port()
    wrapper = folder / "haproxy"
    edits = [
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
        f'exec {shlex.quote(real_binary)} "$@"',
        "",
    ])
    wrapper.write_text(script)
    wrapper.chmod(0o700)
    (folder / "state").mkdir(mode=0o700, exist_ok=True)
    return {
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
        # Ray waits 30 s for HAProxy to answer on its admin socket, and on a busy 2-core machine
        # (Ray's own processes starting beside other work) that start failed once in CI's tests
        "RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S": os.environ.get("RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S", "120"),
    }


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
