"""Every error a user can cause is a NimbleError: one line that says what is wrong and what to do.

The CLI prints `str(error)` on one line and exits with `error.exit_code`; `--debug` adds the traceback.
"""


class NimbleError(Exception):
    """Base of all user-facing errors."""

    exit_code = 1


class UsageError(NimbleError):
    """The command line itself is wrong (a malformed --shape, say)."""

    exit_code = 2


class ModelError(NimbleError):
    """The model file is missing, unreadable, or not a TorchScript archive."""


class ShapeError(NimbleError):
    """The input shapes or dtypes do not fit the model."""


class UnsupportedError(NimbleError):
    """The model uses an op or a construct that nimble cannot lower to a static op list."""


class ArtifactError(NimbleError):
    """A `.nimble` file is missing, corrupt, or from an incompatible version."""


class GraphError(NimbleError):
    """A graph breaks an invariant of the IR (`Graph.lint`)."""


class MismatchError(NimbleError):
    """Outputs differ from the reference beyond the tolerance."""

    exit_code = 3


class ExecutionError(NimbleError):
    """The op list cannot run here: out of memory, an op that fails, a capture that fails."""


class CaptureError(ExecutionError):
    """CUDA graph capture failed; the process's CUDA state may be unusable."""


class NimbleWarning(UserWarning):
    """Something nimble did that the user should know of: a fallback, or a check it relaxed."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none): how nimble
    quotes an error from torch inside its own one-line messages."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def is_out_of_memory(e: BaseException) -> bool:
    """True for the ways torch reports running out of memory: MemoryError, torch's
    OutOfMemoryError, or a RuntimeError from an allocator (the TorchScript interpreter wraps it)."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text
                                            or "DefaultCPUAllocator" in text)
