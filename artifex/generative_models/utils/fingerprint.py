"""A cheap fingerprint of a model directory: which weights a run started from.

A resumed run must start from the same pretrained weights as the run that wrote the checkpoint:
the frozen KL reference is loaded from them again, and a model directory that was replaced in
between (another model of the same shapes, or the run's own export written over it) would change
the results silently. Hashing gigabytes of weights on every start is too slow, so
:func:`directory_fingerprint` records, for every file at the top of the directory: its name,
its size and, for small files (configs, tokenizer files, chat templates), the SHA-256 of its
content; for large ones (weights), the SHA-256 of 64 KiB read at 32 evenly spaced offsets
(the start, with the safetensors header, and the end included). Two different checkpoints of
one architecture differ in nearly every weight, so in the samples.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

__all__ = ["SMALL_FILE_BYTES", "directory_fingerprint"]

#: Files up to this size are hashed whole.
SMALL_FILE_BYTES = 4 << 20
_SAMPLES = 32
_SAMPLE_BYTES = 64 << 10


def _file_digest(path: str, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        if size <= SMALL_FILE_BYTES:
            digest.update(fh.read())
            return digest.hexdigest()
        last = size - _SAMPLE_BYTES
        for k in range(_SAMPLES):
            fh.seek(last * k // (_SAMPLES - 1))
            digest.update(fh.read(_SAMPLE_BYTES))
    return "sampled:" + digest.hexdigest()


def directory_fingerprint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Name, size and (sampled) SHA-256 of every visible file at the top of a directory.

    Hidden files (lock files, temporaries) and subdirectories are left out. A single file
    (a ``.gguf``) is fingerprinted alone.

    Args:
        path: The model directory (or file).

    Returns:
        ``{"files": {name: {"size": bytes, "sha256": hex}}}``; a sampled hash starts with
        ``"sampled:"``.

    Raises:
        FileNotFoundError: ``path`` does not exist.

    Examples:
        >>> import os, tempfile
        >>> from artifex.generative_models.utils.fingerprint import directory_fingerprint
        >>> model = tempfile.mkdtemp()
        >>> with open(os.path.join(model, "config.json"), "w") as fh:
        ...     _ = fh.write('{"hidden_size": 8}')
        >>> before = directory_fingerprint(model)
        >>> before["files"]["config.json"]["size"]
        18
        >>> with open(os.path.join(model, "config.json"), "w") as fh:
        ...     _ = fh.write('{"hidden_size": 9}')  # same size, other content
        >>> directory_fingerprint(model) == before
        False
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        names, directory = [os.path.basename(path)], os.path.dirname(path)
    elif os.path.isdir(path):
        directory = path
        names = sorted(
            n
            for n in os.listdir(path)
            if not n.startswith(".") and os.path.isfile(os.path.join(path, n))
        )
    else:
        msg = f"model path not found: {path}"
        raise FileNotFoundError(msg)
    files = {}
    for name in names:
        full = os.path.join(directory, name)
        size = os.path.getsize(full)
        files[name] = {"size": size, "sha256": _file_digest(full, size)}
    return {"files": files}
