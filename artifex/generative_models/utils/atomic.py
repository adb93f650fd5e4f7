"""Atomic file writes: a reader sees the old file or the complete new one, never a torn one.

Every file is written under a temporary name in its own directory (so the rename never crosses
a file system), flushed and ``fsync``-ed, then renamed over the final name with ``os.replace``
(atomic on POSIX and Windows), and the directory is ``fsync``-ed so the rename survives a power
loss. A write that fails (a full disk, an exception, a kill) leaves the previous file untouched
and, at worst, a temporary file. The next completed write of the same file removes the
temporaries of it that killed writers left (:func:`commit_file`), and a model export removes
those of its whole directory (:func:`remove_temp_files`); a temporary whose writer process is
still running is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["atomic_write", "atomic_write_json", "commit_file", "remove_temp_files", "temp_path"]

#: Temporary files are named ``.<final name>.artifex-tmp-<pid>-<random>`` (the writer's pid).
TEMP_MARKER = ".artifex-tmp-"


def _writer_gone(name: str) -> bool:
    """Whether the process that wrote the temporary ``name`` is no longer running here."""
    pid_text = name.rpartition(TEMP_MARKER)[2].partition("-")[0]
    if not pid_text.isdigit():
        return True  # not a name this module writes: nobody is writing it
    pid = int(pid_text)
    if pid == os.getpid():
        return False  # this process's own write, possibly in progress in another thread
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: a live process of another user
        return False
    return False


def temp_path(path: str | os.PathLike[str]) -> str:
    """A fresh temporary name next to ``path`` (same directory, hence same file system).

    Args:
        path: The final file name.

    Returns:
        The temporary file name (the file is not created).

    Examples:
        >>> import os, tempfile
        >>> from artifex.generative_models.utils import temp_path
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.json")
        >>> tmp = temp_path(path)
        >>> os.path.dirname(tmp) == os.path.dirname(path), os.path.exists(tmp)
        (True, False)
    """
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}{TEMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}")


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit_file(tmp: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Makes a completely written temporary file the file ``path`` (fsync, then rename).

    Args:
        tmp: The temporary file (from :func:`temp_path`), closed.
        path: The final name; an existing file of that name is replaced atomically.

    Examples:
        >>> import os, tempfile
        >>> from artifex.generative_models.utils import commit_file, temp_path
        >>> path = os.path.join(tempfile.mkdtemp(), "out.txt")
        >>> tmp = temp_path(path)
        >>> with open(tmp, "w") as f:
        ...     _ = f.write("done")
        >>> commit_file(tmp, path)
        >>> open(path).read(), os.path.exists(tmp)
        ('done', False)
    """
    tmp, path = os.fspath(tmp), os.fspath(path)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    directory, name = os.path.split(os.path.abspath(path))
    remove_temp_files(directory, target=name)  # left by earlier writes of it that were killed


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str], mode: str = "w", *, encoding: str | None = "utf-8"
) -> Iterator[IO[Any]]:
    """Opens a temporary file that becomes ``path`` when the block exits without error.

    Args:
        path: The final file name (its directory must exist).
        mode: ``"w"`` (text) or ``"wb"`` (bytes).
        encoding: Text encoding (ignored for ``"wb"``).

    Yields:
        The open temporary file.

    Raises:
        ValueError: For a mode other than ``"w"`` or ``"wb"``.
        OSError: When writing fails (the previous file, if any, is left as it was).

    Examples:
        >>> import os, tempfile
        >>> from artifex.generative_models.utils import atomic_write
        >>> path = os.path.join(tempfile.mkdtemp(), "notes.txt")
        >>> with atomic_write(path) as f:
        ...     _ = f.write("complete")
        >>> open(path).read()
        'complete'
        >>> try:
        ...     with atomic_write(path) as f:
        ...         _ = f.write("torn")
        ...         raise RuntimeError("killed")
        ... except RuntimeError:
        ...     pass
        >>> open(path).read()  # the old file, untouched
        'complete'
    """
    if mode not in ("w", "wb"):
        msg = f"atomic_write mode must be 'w' or 'wb', got {mode!r}"
        raise ValueError(msg)
    tmp = temp_path(path)
    try:
        with open(tmp, mode, encoding=None if "b" in mode else encoding) as fh:
            yield fh
            fh.flush()
        commit_file(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 2) -> None:
    """Writes ``obj`` as JSON (plus a final newline) to ``path`` atomically.

    Args:
        path: The final file name.
        obj: A JSON-able object.
        indent: JSON indentation.

    Examples:
        >>> import json, os, tempfile
        >>> from artifex.generative_models.utils import atomic_write_json
        >>> path = os.path.join(tempfile.mkdtemp(), "config.json")
        >>> atomic_write_json(path, {"lr": 0.001, "steps": 100}, indent=None)
        >>> json.load(open(path))
        {'lr': 0.001, 'steps': 100}
    """
    text = json.dumps(obj, indent=indent, sort_keys=False) + "\n"  # fails before any write
    with atomic_write(path, "w") as fh:
        fh.write(text)


def remove_temp_files(directory: str | os.PathLike[str], *, target: str | None = None) -> list[str]:
    """Deletes the temporaries that killed atomic writes left in ``directory``.

    Only temporaries whose writer process is no longer running on this machine are removed
    (their names hold the writer's pid): a write in progress in another process keeps its file.
    Temporary directories (a model converted into a staging directory) are removed too.

    Args:
        directory: The directory (missing: nothing to do).
        target: Only the temporaries of this final name (``"model.safetensors"``); ``None``:
            those of every name.

    Returns:
        The names removed.

    Examples:
        >>> import os, subprocess, sys, tempfile
        >>> from artifex.generative_models.utils import remove_temp_files
        >>> directory = tempfile.mkdtemp()
        >>> gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
        ...                       capture_output=True, text=True).stdout.strip()  # has exited
        >>> open(os.path.join(directory, f".a.json.artifex-tmp-{gone}-0a1b"), "w").close()
        >>> remove_temp_files(directory, target="b.json")  # another file's: kept
        []
        >>> len(remove_temp_files(directory)), os.listdir(directory)
        (1, [])
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    prefix = "." if target is None else f".{target}{TEMP_MARKER}"
    removed = []
    for name in os.listdir(directory):
        if not (name.startswith(prefix) and TEMP_MARKER in name) or not _writer_gone(name):
            continue
        full = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.remove(full)
            removed.append(name)
    return removed
