"""Atomic file writes that a kill cannot leave behind, with the mode a user expects.

`atomic_file(path)` writes into a temp file in the destination's folder and renames it over
`path` when the block ends, so readers see the old file or the new one, never a part of it.

- On Linux the temp file is unnamed (`O_TMPFILE`): a SIGKILL while writing leaves nothing on
  disk. It gets a name only for the instant of the rename.
- Elsewhere, or on a file system without `O_TMPFILE`, it is named `.NAME.nimble-PID-RANDOM.tmp`.
  Every write into a folder first removes such files whose process is gone, so debris from a kill
  lasts until the next write there at most.
- The file gets the mode a plain `open()` would give: 0666 less the umask, or the old file's
  permission bits when it replaces one (never setuid, setgid or sticky).
- It replaces only a regular file (or a link, itself): never a device, FIFO, socket or folder.
- `durable=False` is for caches, whose readers check what they read and treat a damaged file as
  a miss: no fsync, and each folder is swept of stale temp files once per process rather than
  before every write (a load writes hundreds of cache files; fsync and the sweep were a second
  of densenet121's load on the H200).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import stat
from pathlib import Path
from typing import BinaryIO, Iterator

_TEMP = re.compile(r"^\.(?P<name>.+)\.nimble-(?P<pid>\d+)-[0-9a-f]+\.tmp$")
_SWEPT: set[str] = set()  # folders this process swept of stale temp files


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, durable: bool = True) -> Iterator[BinaryIO]:
    """A binary file that appears at `path` only once the block finishes. On any error, or an
    interrupt, nothing is left behind. `durable`: synced to disk before it appears (see the
    module docstring)."""
    path = Path(path)
    folder = path.parent
    with contextlib.suppress(FileNotFoundError):
        found = os.lstat(path).st_mode
        if not (stat.S_ISREG(found) or stat.S_ISLNK(found)):
            raise OSError(errno.EISDIR if stat.S_ISDIR(found) else errno.EEXIST, "exists and is not a regular file",
                          str(path))
    if durable or str(folder) not in _SWEPT:
        _SWEPT.add(str(folder))
        remove_stale_temps(folder)
    mode = _mode_for(path)
    named: Path | None = None
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o600)  # unnamed: a kill leaves nothing
    except (AttributeError, OSError):  # not Linux, or a file system without O_TMPFILE
        named = _temp_name(path)
        try:
            fd = os.open(named, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except OSError as e:  # name the file the user asked for, not the temporary one
            raise OSError(e.errno, e.strerror, str(path)) from e
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), mode)
            if durable:
                os.fsync(f.fileno())
            if named is None:  # a name for the rename only
                named = _temp_name(path)
                _link(f.fileno(), named)
        os.replace(named, path)
    except OSError as e:  # name the file the user asked for, not the temporary one
        if named is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(named)
        raise OSError(e.errno, e.strerror, str(path)) from e
    except BaseException:
        if named is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(named)
        raise


def _link(fd: int, name: Path) -> None:
    """Give the unnamed file `fd` a name: linkat(2) through /proc, following the fd's link (a
    plain link(2) would link the /proc entry itself)."""
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(str(fd), name, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def _temp_name(path: Path) -> Path:
    return path.parent / f".{path.name}.nimble-{os.getpid()}-{secrets.token_hex(6)}.tmp"


def _mode_for(path: Path) -> int:
    """The old file's permission bits (no special bits), or what the umask leaves of 0666."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def remove_stale_temps(folder: str | os.PathLike) -> None:
    """Remove nimble's temp files in `folder` whose writing process no longer exists."""
    try:
        entries = os.scandir(folder)
    except OSError:
        return
    with entries:
        for entry in entries:
            m = _TEMP.match(entry.name)
            if m is None or _alive(int(m.group("pid"))):
                continue
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process, or not a pid we can ask about: leave its file
    return True


def write_atomic(path: str | os.PathLike, data: bytes, durable: bool = True) -> None:
    with atomic_file(path, durable) as f:
        f.write(data)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True if `a` and `b` name one file: the same path once resolved, or the same inode."""
    a, b = Path(a), Path(b)
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
