"""Writing checkpoint files: durably, atomically, and with the mode the user's umask gives.

A shared cluster file system needs checkpoint files readable as the user's other files are, so
every file is left with mode ``0o666 & ~umask``, as a plain ``open()`` creates it; ``tempfile`` and
safetensors' ``save_file`` (which writes a temporary and renames it) make theirs 0600.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Callable


def umask() -> int:
    """The process's umask, read without changing it where Linux reports it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, but only for a moment)
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """Give ``path`` the mode a plain ``open()`` would have created it with."""
    os.chmod(path, 0o666 & ~umask())


def write_durably(path: Path, data: bytes) -> None:
    """``data`` into ``path``, flushed to the disk before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: Path, write: Callable[[Path], Any]) -> None:
    """``write(tmp)`` into a new file beside ``path``, flushed to disk, then renamed over ``path``: a
    crash leaves the old file or the new one, never a half-written one."""
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; give the path of the file to write, such as "
                                f"{path / 'consolidated.ckpt'}.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.partial"  # O_EXCL: a concurrent writer's is apart
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        write(tmp)
        with open(tmp, "rb+") as f:  # the rename must not become durable before the contents do
            os.fsync(f.fileno())
        follow_umask(tmp)  # a writer that replaced the file (safetensors) made it 0600
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
