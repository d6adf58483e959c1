"""What a `nimble serve` killed outright (SIGKILL, the OOM killer) would leave behind: Ray's
processes and HAProxy, still listening. A small process started before Ray, in a session of its
own, notes the server's descendants twice a second; when the server is gone (its end of a pipe
closes, however it ended), it ends those that are left (SIGTERM, then SIGKILL) and removes the
server's private folder. Those it ends are the descendants it saw, their descendants now, and every
process of this user whose environment carries the server's mark (`MARK`, set before Ray starts and
inherited by all it starts): a process started after the last look, or left to init when its parent
went, is found all the same. A zombie counts as gone: it holds no port and runs nothing. A stop that went well leaves it nothing to do. Linux (/proc) only;
elsewhere it only removes the folder. Standard library only: it starts in a few milliseconds.

    python -m nimble.serve.reaper SERVER_PID FOLDER    (stdin: the server's end of the pipe)
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


MARK = "NIMBLE_SERVE_FOLDER"  # in the environment of the server's processes: its private folder


def start(folder: Path) -> subprocess.Popen:
    """The reaper of this process and `folder`; closing its stdin (or this process ending) sets it off.
    Marks this process's environment, so that whatever it starts from now on carries the mark."""
    proc = subprocess.Popen([sys.executable, "-m", "nimble.serve.reaper", str(os.getpid()), str(folder)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    os.environ[MARK] = str(folder)
    return proc


def _entry(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, name, start time) of a live process, None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2:].split()
    if rest[0] in ("Z", "X"):
        return None
    return int(rest[1]), stat[stat.index("(") + 1:stat.rindex(")")], rest[19]


def marked(folder: str, table: dict | None = None) -> dict[int, str]:
    """pid -> start time of every live process (of those this user may read) marked with `folder`."""
    mark = f"{MARK}={folder}".encode()
    found = {}
    for pid, (_, _, started) in (processes() if table is None else table).items():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if mark in environ.split(b"\0"):
            found[pid] = started
    return found


def processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, name, start time) of every process (Linux /proc; empty elsewhere)."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        if (e := _entry(int(entry.name))) is not None:
            found[int(entry.name)] = e
    return found


def descendants(root: int, table: dict | None = None) -> dict[int, tuple[str, str]]:
    """pid -> (name, start time) of `root`'s descendants."""
    table = processes() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in out:
            out[pid] = table[pid][1:]
            todo.extend(children.get(pid, []))
    return out


def _alive(pid: int, started: str) -> bool:
    entry = _entry(pid)
    return entry is not None and entry[2] == started


def main(server: int, folder: str) -> None:
    seen: dict[int, str] = {}
    while True:
        ready, _, _ = select.select([0], [], [], 0.5)
        if ready and not os.read(0, 4096):
            break  # the server is gone, or it closed the pipe after its own stop
        seen.update((pid, started) for pid, (_, started) in descendants(server).items() if pid != os.getpid())
    table = processes()
    for pid in list(seen):
        seen.update((p, started) for p, (_, started) in descendants(pid, table).items())
    seen.update(marked(folder, table))
    mine = _entry(os.getpid())
    server_entry = _entry(server)
    spared = {(os.getpid(), mine and mine[2]), (server, server_entry and server_entry[2])}
    left = {pid: started for pid, started in seen.items() if _alive(pid, started) and (pid, started) not in spared}
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 1.0)):
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait_s
        while time.time() < deadline and any(_alive(p, s) for p, s in left.items()):
            time.sleep(0.1)
        left = {p: s for p, s in left.items() if _alive(p, s)}
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
