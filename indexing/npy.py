"""numpy's ``.npy`` / ``.npz`` reading, safe in threads.

``np.load`` parses each array's header with ``ast.literal_eval``. On CPython 3.11 the AST
constructor keeps one recursion counter per interpreter, not per thread: two threads
parsing at once can raise ``SystemError: AST constructor recursion depth mismatch``
(python/cpython#106905). Opening shards side by side did exactly that, now and then, on a
cold replica. Every header is therefore parsed under one lock; the arrays are small
(centroids, list tables, codec parameters), so the lock costs microseconds.
"""

from __future__ import annotations

import io
import threading

import numpy as np

_LOCK = threading.Lock()


def load_array(raw: bytes) -> np.ndarray:
    """The one array of a ``.npy`` file's bytes (no pickles)."""
    with _LOCK:
        array: np.ndarray = np.load(io.BytesIO(raw), allow_pickle=False)
        return array


def load_arrays(raw: bytes) -> dict[str, np.ndarray]:
    """Every array of a ``.npz`` file's bytes, by name (no pickles)."""
    with _LOCK, np.load(io.BytesIO(raw), allow_pickle=False) as z:
        return {name: z[name] for name in z.files}
