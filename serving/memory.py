"""Keeping a long-running CPU embedder's memory flat.

Two measured problems (a 10k-document stream grew the job from 0.7 to 1.6 GB):

- oneDNN caches a compiled primitive per input shape; with variable-length batches that
  cache grows the process by hundreds of MB and buys no measurable speed on CPU. It is
  turned off here, which must happen before torch loads (``serving.embedder`` imports this
  module first);
- torch's CPU activations for batches of varying shapes leave glibc holding freed arenas:
  :func:`release_freed_memory` gives them back after each batch.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")


def _load_malloc_trim() -> Any:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_freed_memory() -> None:
    """Give glibc's freed arenas back to the OS after a batch.

    Torch's CPU activations for batches of varying shapes leave glibc holding freed
    memory: without this the job grew from 0.7 to 1.6 GB over a 10k-document stream;
    with it RSS stays under 0.95 GB. Costs 1-7 ms against a batch's ~1 s.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
