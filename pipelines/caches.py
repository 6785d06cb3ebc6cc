"""One bounded, thread-safe LRU cache for every in-process cache of the project.

    cache: LRU[str, np.ndarray] = LRU(4096)
    vector = cache.get_or_make(text, lambda: embed(text))
    cache.get(key), cache.put(key, value)

(The shard cache of the retrieval service is another thing: bounded in bytes, with a
disk tier; see ``retrieval.cache``.)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most ``size`` items; the least recently used goes first. ``size`` 0 keeps nothing."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K) -> V | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: K, value: V) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The cached value, or ``make()``'s (made outside the lock: two callers may both make it)."""
        found = self.get(key)
        if found is None:
            found = make()
            self.put(key, found)
        return found
