"""What torch's exporter and tracer leave behind, kept from the user: what they print (a failed
torch.export writes its partial graph, dozens of lines, to stderr and logs warnings, before nimble
says in one line why it was refused; `NIMBLE_DEBUG=1` lets all of it through), and the module's
buffers that a trace's forward updates (`buffers_kept`)."""

from __future__ import annotations

import contextlib
import io
import logging
import os


def debugging() -> bool:
    return os.environ.get("NIMBLE_DEBUG", "") not in ("", "0")


@contextlib.contextmanager
def quiet_torch():
    """Within: torch's loggers silenced and Python-level stdout and stderr held; what was held is
    `buffer.getvalue()` of the yielded buffer (for a caller that wants to show it)."""
    held = io.StringIO()
    if debugging():
        yield held
        return
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.split(".")[0] == "torch"]
    loggers.append(logging.getLogger("torch"))
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        with contextlib.redirect_stderr(held), contextlib.redirect_stdout(held):
            yield held
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def buffers_kept(module):
    """Within: anything; after: `module`'s buffers hold what they held before (a trace runs the
    forward, which moves batch norm's running statistics)."""
    import torch

    buffers = list(module.buffers())
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)
