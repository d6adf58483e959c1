"""`nimble serve` started and stopped in ways the shared server of test_server.py cannot be: killed
outright, refused before Ray starts, or failing inside Ray Serve's start. A file of its own, so
that a parallel run (`pytest -n 2`) runs it beside test_server.py."""

import socket
import subprocess
import time

import pytest

pytest.importorskip("ray.serve")

from ..conftest import SAMPLES  # noqa: E402
from .test_server import NIMBLE, free_port, nimble  # noqa: E402


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    done = nimble("compile", str(SAMPLES / "resnet.pt"), "-s", "1x3x64x64", "--batch-sizes", "1,2,4", "-o",
                  str(folder / "resnet.nimble"))
    assert done.returncode == 0, done.stderr
    return folder


def test_a_server_killed_outright_leaves_nothing_behind(artifacts, tmp_path):
    from nimble.serve import reaper

    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([NIMBLE, "serve", str(artifacts / "resnet.nimble"), "--port", str(port),
                                 "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--device", "cpu"],
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    deadline = time.time() + 240
    while "ready at" not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    started = reaper.descendants(proc.pid)
    assert any(name == "haproxy" for name, _ in started.values()), started
    proc.kill()  # SIGKILL: no handler, no atexit
    proc.wait()
    deadline = time.time() + 60
    while time.time() < deadline and any(reaper._alive(pid, when) for pid, (_, when) in started.items()):
        time.sleep(0.5)
    assert not [name for pid, (name, when) in started.items() if reaper._alive(pid, when)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the port is free again


def test_a_port_in_use_is_one_line_before_ray_starts(artifacts):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        done = nimble("serve", str(artifacts / "resnet.nimble"), "--port", str(s.getsockname()[1]), "--device", "cpu")
    assert done.returncode == 2 and "cannot be opened on 127.0.0.1" in done.stderr
    assert "starting Ray" not in done.stderr and "Traceback" not in done.stderr


def test_an_artifact_whose_batch_sizes_mix_rows_is_never_served(tmp_path):
    import torch

    from nimble.formats import write_artifact
    from nimble.formats.artifact import Artifact
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs

    from ..conftest import save_script

    class Rolls(torch.nn.Module):
        def forward(self, x):
            return torch.roll(x, 1, 0) * 2

    one, two = (compile_model(save_script(tmp_path, Rolls(), f"r{b}"), input_specs([f"{b}x5"]), device="cpu")
                for b in (1, 2))
    top = one.artifact()
    write_artifact(tmp_path / "rolls.nimble", Artifact({**top.manifest, "batch_sizes": [1, 2]}, top.graph,
                                                        top.schedule, top.memory, top.weights, top.sample_inputs,
                                                        top.sample_outputs, {2: (two.graph, two.schedule, two.memory)}))
    done = nimble("serve", str(tmp_path / "rolls.nimble"), "--device", "cpu", "--port", str(free_port()))
    assert done.returncode == 1 and "holds the rows" in done.stderr and "Traceback" not in done.stderr
    assert "starting Ray" not in done.stderr


def test_a_failure_inside_ray_serve_s_start_is_one_line_with_its_innermost_cause():
    """What Ray raises from a task (its error wrapping the task's own) becomes one line naming
    the cause; an HAProxy failure suggests Ray's own proxy."""
    from nimble.serve.lifecycle import Options, start_failure

    class TaskError(Exception):  # the shape of ray.exceptions.RayTaskError: the task's error in .cause
        def __init__(self, cause):
            super().__init__("ray::HAProxyManager.ready() (pid=1, ip=192.0.2.2, actor_id=...)\nmore")
            self.cause = cause

    haproxy = TaskError(RuntimeError("HAProxy (pid=7) did not take over the admin socket within 30 seconds. "
                                     "stderr: \nline two"))
    line = start_failure(haproxy, Options(ingress="haproxy"))
    assert line == ("Ray Serve did not start the models (RuntimeError: HAProxy (pid=7) did not take over the admin "
                    "socket within 30 seconds. stderr:); serve with --ingress proxy (Ray Serve's own HTTP proxy), "
                    "or try again")
    crashed = TaskError(RuntimeError("HAProxy crashed during startup: [NOTICE]   (6558) : haproxy version is 2.8.25\n"
                                     "[NOTICE]   (6558) : path to executable is /usr/sbin/haproxy\n"
                                     "[ALERT]    (6558) : Binding [cfg:12] for frontend http: cannot bind socket "
                                     "(Address already in use) for [127.0.0.1:41001]"))
    said = start_failure(crashed, Options(ingress="haproxy"))
    assert said.startswith("Ray Serve did not start the models (RuntimeError: HAProxy: Binding [cfg:12] for frontend "
                           "http: cannot bind socket (Address already in use) for [127.0.0.1:41001]); serve with"), said
    other = start_failure(TaskError(ValueError("bad config")), Options(ingress="proxy"))
    assert other.startswith("Ray Serve did not start the models (ValueError: bad config); run it again with --debug")
    assert "\n" not in line + other


def test_ports_picked_for_a_server_are_free_and_where_no_other_process_takes_them_unasked():
    """`free_port` picks below the ranges that Ray's workers, its replicas' direct ingress and the
    kernel's port-0 binds draw from; the replicas' ranges move off the ports HAProxy will bind."""
    import socket

    from nimble.serve import ingress

    ephemeral = ingress._ephemeral_ports()
    picked = {ingress.free_port() for _ in range(20)}
    for port in picked:
        assert ingress.port_in_use("127.0.0.1", port) is None
        if ingress.QUIET_PORTS.start < ephemeral.start:
            assert port in ingress.QUIET_PORTS and port not in ephemeral
    with socket.socket() as held:  # a port already held is never picked
        held.bind(("127.0.0.1", min(picked)))
        assert min(picked) not in {ingress.free_port() for _ in range(50)}
    env = ingress.direct_ingress_ports([8000, 40500])
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == \
        ("30000", "31000")
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"]) == \
        ("41001", "42001")
