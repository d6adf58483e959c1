"""The reaper that ends what a `nimble serve` killed outright left behind, without Ray: a stand-in
server starts it, then a process that leaves itself to init (as HAProxy does when Ray's proxy goes
first) and one started after the reaper's last look; both must go when the server is SIGKILLed."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nimble.serve import reaper

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the reaper reads Linux's /proc")

SERVER = r"""
import os, subprocess, sys, time
from pathlib import Path
from nimble.serve import reaper
folder = Path(sys.argv[1])
reaper.start(folder)
# an orphan: its parent exits at once, so init adopts it and it is no descendant of this process
subprocess.Popen([sys.executable, "-c",
                  "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
                  " start_new_session=True)"]).wait()
time.sleep(0.05)
# a child started just before the end, likely after the reaper's last look
late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
print(late.pid, flush=True)
time.sleep(300)
"""


def _sleepers_marked(folder: Path) -> dict[int, str]:
    return {pid: when for pid, when in reaper.marked(str(folder)).items()
            if b"time.sleep(300)" in Path(f"/proc/{pid}/cmdline").read_bytes()}


def test_the_server_killed_outright_leaves_no_process_and_no_folder(tmp_path):
    folder = tmp_path / "private"
    folder.mkdir()
    (folder / "state").write_text("x")
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(folder)], stdout=subprocess.PIPE, text=True)
    late = int(server.stdout.readline())
    deadline = time.time() + 30
    while len(sleepers := _sleepers_marked(folder)) < 2:
        assert time.time() < deadline, sleepers
        time.sleep(0.1)
    assert late in sleepers
    server.kill()  # no handler, no atexit
    server.wait()
    deadline = time.time() + 30
    while time.time() < deadline and (any(reaper._alive(p, w) for p, w in sleepers.items()) or folder.exists()):
        time.sleep(0.2)
    assert not [p for p, w in sleepers.items() if reaper._alive(p, w)]
    assert not folder.exists()


def test_a_process_without_the_mark_is_left_alone(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    try:
        env = dict(os.environ, **{reaper.MARK: str(tmp_path / "another")})
        marked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env=env)
        time.sleep(0.3)
        found = reaper.marked(str(tmp_path / "another"))
        assert marked.pid in found and other.pid not in found
        marked.send_signal(signal.SIGKILL)
        marked.wait()  # reaped: gone
        assert marked.pid not in reaper.marked(str(tmp_path / "another"))
    finally:
        other.kill()
        other.wait()
