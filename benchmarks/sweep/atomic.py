"""Atomic file writes: a reader sees the old file or the complete new one, never half.

The content goes to a temporary file in the same directory (same file system), is
flushed and ``fsync``-ed, and then ``os.replace``-d onto the target, which is atomic
on POSIX; the directory is ``fsync``-ed too, so that the rename survives a power
loss. A process killed while writing (SIGTERM, SIGKILL) leaves at most the temporary
file ``<name>.tmp-<pid>``, which no reader looks for; an exception (SIGINT's
``KeyboardInterrupt``) removes it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def temporary_path(path: Path) -> Path:
    """The temporary file of :func:`write_atomically` for ``path`` in this process."""
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


def write_atomically(
    path: Path, write: Callable[[IO[Any]], object], binary: bool = False
) -> Path:
    """Write a file through ``write(stream)`` so that it appears complete or not at all.

    Args:
        path: The target file (its directory is created if missing).
        write: Writes the content into the open stream.
        binary: Open the stream in binary mode (``torch.save``) instead of text.

    Returns:
        ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(path)
    try:
        with open(temporary, "wb" if binary else "w") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the OS allows it)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory handles
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
