"""Writing a file whole or not at all: through a temporary file beside it, moved into place when complete."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def replaced_atomically(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path beside ``path`` (same folder, so the move is one rename) to write to; on success it
    replaces ``path``, on any failure it is removed, so no half-written file or stray temporary is left."""
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
