"""nimble's cache folder, read as carefully as an artifact.

The folder holds generated kernel sources, records of compiled kernels (`binaries/`), the tuning
choices (`tuning.json`), the cuDNN plan choices (`cudnn_plans.json`) and the per-call kernel
choices (`kernel_choices.json`, `recall.py`). Another user
who can write into it could plant a file that nimble then trusts, so:
- the folder is created 0700; one not owned by this user, or writable by group or others, is
  not used at all (nimble says so once per process, and runs without a cache);
- a cache file is read only if it is a regular file (no FIFO, no symlink) of at most a stated
  size, and any failure to read it counts as a miss;
- files are written through `fileio.atomic_file`: an exclusive temp file, then a rename, so a
  planted temp name or symlink is never written through;
- nothing read from the cache is imported or executed: kernels are compiled from the source
  text generated in this process (`kernels.py`), and a record of a compiled kernel
  (`binaries.py`) only names the binary in Triton's own cache, which is launched while its size
  and sha256 are the ones Triton built.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

from ...fileio import write_atomic

_WARNED: set[str] = set()


def cache_root() -> Path:
    """Where the cache lives: $NIMBLE_CACHE_DIR, else $XDG_CACHE_HOME/nimble, else ~/.cache/nimble."""
    if os.environ.get("NIMBLE_CACHE_DIR"):
        return Path(os.environ["NIMBLE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nimble"


def cache_dir(sub: str = "") -> Path | None:
    """The cache folder (or its subfolder `sub`), created 0700 if missing; None if it cannot be
    made or is not safe to use (see the module docstring)."""
    folder = cache_root() / sub if sub else cache_root()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        for f in (cache_root(), folder):
            st = os.stat(f, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                return _unsafe(f, "is not a folder")
            if hasattr(os, "getuid") and st.st_uid != os.getuid():
                return _unsafe(f, "belongs to another user")
            if st.st_mode & 0o022:
                return _unsafe(f, "can be written by other users")
    except OSError as e:
        return _unsafe(folder, f"cannot be used ({e.strerror or e})")
    return folder


def _unsafe(folder: Path, why: str) -> None:
    if str(folder) not in _WARNED:
        _WARNED.add(str(folder))
        print(f"nimble: the cache folder {folder} {why}; running without a cache (set NIMBLE_CACHE_DIR to a folder "
              "of your own, mode 0700)", file=sys.stderr)
    return None


def read_small(path: Path, limit: int) -> bytes | None:
    """The bytes of `path` if it is a regular file of at most `limit` bytes, else None. Never
    blocks on a FIFO and never follows a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        data = os.read(fd, limit + 1)
        return data if len(data) <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)


def write(path: Path, data: bytes) -> bool:
    """Write `data` to `path` atomically, not synced to disk (every reader checks what it reads);
    False (and nothing left behind) if it cannot be written."""
    try:
        write_atomic(path, data, durable=False)
        return True
    except OSError:
        return False


def read_table(path: Path | None, limit: int) -> dict:
    """The JSON object in `path`: {} unless it is a regular file of at most `limit` bytes that
    holds one."""
    data = None if path is None else read_small(path, limit)
    try:
        table = json.loads(data) if data is not None else {}
    except (ValueError, RecursionError):
        return {}
    return table if isinstance(table, dict) else {}


def write_entry(path: Path | None, key: str, entry, limit: int) -> None:
    """Set `key` in the table at `path` (newest last); a cache that cannot be written is skipped
    silently. The older half of the entries goes whenever the table would pass `limit` bytes."""
    if path is None:
        return
    table = read_table(path, limit)
    table.pop(key, None)
    table[key] = entry
    data = json.dumps(table, indent=1).encode()
    while len(data) > limit and len(table) > 1:  # drop the older half, newest kept
        for old in list(table)[:len(table) // 2]:
            del table[old]
        data = json.dumps(table, indent=1).encode()
    write(path, data)
