"""Processes that build kernels for a load or a pack, each a fresh `python -c` of nimble's build
loop (`aot.serve_builds`), fed jobs over its pipes.

Why not `multiprocessing`: its spawned workers import the parent's `__main__` module again, so a
user's script that loads an artifact without an `if __name__ == "__main__":` guard would run
again in every worker (each would load the model anew, and then fail to start workers of its
own). A worker started here imports only torch, Triton and nimble's kernel modules, as
Inductor's compile workers do.

A worker spends 2 to 3 s importing them. A cold load starts its workers beside its walk
(`prebuild.py`): they are ready when it ends, and every kernel it found builds on them. `close`
kills them, used or not, so nothing outlives the load.

Each message is a pickle with its length before it. The parent only sends jobs to processes it
started and reads their answers; nothing read from a file or a client travels here.
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
import threading

WORKER = "from nimble.runtime.kernels.aot import serve_builds; serve_builds()"


class Builders:
    """`count` build processes, started now."""

    def __init__(self, count: int):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # nimble as this process finds it
        self._procs = []
        try:
            for _ in range(count):
                self._procs.append(subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env))
        except (OSError, ValueError, TypeError):  # no interpreter to start (sys.executable empty), no processes
            self.close()
            raise OSError("build processes cannot start here") from None

    def run(self, jobs: list) -> list:
        """Each job's answer, in order, from whichever worker is free; None for a job that a worker
        died on (that worker takes no more)."""
        answers: list = [None] * len(jobs)
        todo: queue.Queue = queue.Queue()
        for i, job in enumerate(jobs):
            todo.put((i, job))

        def drive(proc: subprocess.Popen) -> None:
            while True:
                try:
                    i, job = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    send(proc.stdin, job)
                    answers[i] = receive(proc.stdout)
                except (OSError, EOFError, ValueError, pickle.UnpicklingError):
                    return  # this worker is gone; the others take what is left

        drivers = [threading.Thread(target=drive, args=(p,), daemon=True) for p in self._procs]
        for d in drivers:
            d.start()
        for d in drivers:
            d.join()
        return answers

    def close(self) -> None:
        for proc in self._procs:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()
                except OSError:  # what was left unsent to a process that is gone
                    pass
        self._procs = []


def send(pipe, value) -> None:
    data = pickle.dumps(value)
    pipe.write(struct.pack("<Q", len(data)) + data)
    pipe.flush()


def receive(pipe):
    """The next message, or EOFError where the other end is gone."""
    head = pipe.read(8)
    if len(head) < 8:
        raise EOFError("the build process is gone")
    size = struct.unpack("<Q", head)[0]
    data = pipe.read(size)
    if len(data) < size:
        raise EOFError("the build process is gone")
    return pickle.loads(data)
