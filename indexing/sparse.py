"""The disk tier of ranged reads: a local, sparse copy of one immutable remote file.

A compressed shard's lists and float vectors are read from object storage by byte range
(``indexing.store.get_ranges``). ``SparseCopy`` sits in front of those reads: a range
already on local disk is read from it (``pread``, so the kernel's page cache is the
memory tier above it, elastic and shared across processes); any other range is fetched,
returned and written into a sparse file of the remote file's size. What was written is
appended to a small log beside the file, so a restarted replica keeps its disk tier.

Nothing read from disk is trusted: the caller checks each range against its digest from
the manifest's list table and, on a mismatch, reads it again with ``fresh=True``, which
goes to the store and overwrites the local bytes. A torn write or a crash between data
and log therefore costs one refetch, never a wrong answer. ``pread`` rather than ``mmap``:
the cache may delete a copy at any time to stay within its disk bound, and a mapping of a
file that shrinks faults (SIGBUS) where a read just fails.
"""

from __future__ import annotations

import bisect
import logging
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from serving.waiting import may_wait

log = logging.getLogger(__name__)

#: (start, length) ranges → their bytes in order, requests made, bytes moved
RangeFetch = Callable[[list[tuple[int, int]]], tuple[list[bytes], int, int]]

_RECORD = struct.Struct("<QQ")  # one written (start, length)


class Intervals:
    """Disjoint, sorted [start, end) intervals: what of a file is on disk."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self.ends, start)  # first interval that ends at or after start
        j = bisect.bisect_right(self.starts, end)  # intervals [i, j) touch [start, end]
        if i < j:
            start, end = min(start, self.starts[i]), max(end, self.ends[j - 1])
        self.starts[i:j], self.ends[i:j] = [start], [end]

    def covers(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self.starts, start) - 1
        return i >= 0 and self.ends[i] >= end

    @property
    def total(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends, strict=True))


class _File:
    """An open descriptor, closed when the last user lets go of it (a thread mid-read keeps
    it open, so a reopen can never hand its number to another file under that read)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.ino = os.fstat(fd).st_ino

    def __del__(self) -> None:
        os.close(self.fd)


class SparseCopy:
    """Ranged reads of one remote file through a local sparse copy of it (see the module)."""

    def __init__(
        self,
        path: Path,
        size: int,
        fetch: RangeFetch,
        on_write: Callable[[int], None] | None = None,
        on_disk_read: Callable[[int], None] | None = None,
    ) -> None:
        """``on_write(n)``: the copy took ``n`` more bytes of disk; ``on_disk_read(n)``: ``n``
        ranges were read from disk instead of the store."""
        self.path = path
        self.log_path = path.with_name(f".{path.name}.have")
        self.size = size
        self._fetch = fetch
        self._on_write = on_write
        self._on_disk_read = on_disk_read
        self._lock = threading.Lock()
        self._file: _File | None = None
        self._have = Intervals()
        self._broken = False  # a failing disk degrades to reading from the store

    def read_local(self, ranges: list[tuple[int, int]]) -> list[bytes] | None:
        """Every range's bytes from the local copy, or None (nothing read from the store) if
        it lacks one or a read fails: the warm path, without a thread hop or a second lookup."""
        may_wait(f"reading {self.path}")
        if self._broken:
            return None
        # a restarted copy learns what it holds from its log; ``file`` is held until the
        # reads end, so its descriptor cannot close under them
        try:
            file = self._open()
        except OSError:
            return None
        with self._lock:
            if not all(self._have.covers(s, s + n) for s, n in ranges):
                return None
        out = []
        try:
            for start, length in ranges:
                data = os.pread(file.fd, length, start)
                if len(data) != length:
                    return None
                out.append(data)
        except OSError:
            return None
        if self._on_disk_read is not None:
            self._on_disk_read(len(ranges))
        return out

    def __call__(self, ranges: list[tuple[int, int]], fresh: bool = False) -> tuple[list[bytes], int, int]:
        may_wait(f"reading {self.path}")  # the disk, or the store for what it lacks
        if self._broken:
            return self._fetch(ranges)
        try:
            file = self._open()
        except OSError as exc:
            return self._give_up(exc, ranges)
        fd = file.fd
        out: list[bytes | None] = [None] * len(ranges)
        if not fresh:
            with self._lock:
                local = [i for i, (s, n) in enumerate(ranges) if self._have.covers(s, s + n)]
            for i in local:
                start, length = ranges[i]
                try:
                    data = os.pread(fd, length, start)
                except OSError:
                    continue
                if len(data) == length:
                    out[i] = data
        missing = [i for i, blob in enumerate(out) if blob is None]
        if len(missing) < len(ranges) and self._on_disk_read is not None:
            self._on_disk_read(len(ranges) - len(missing))
        requests = nbytes = 0
        if missing:
            blobs, requests, nbytes = self._fetch([ranges[i] for i in missing])
            for i, blob in zip(missing, blobs, strict=True):
                out[i] = blob
            self._write(file, [(ranges[i][0], blobs[k]) for k, i in enumerate(missing)])
        return [b if b is not None else b"" for b in out], requests, nbytes

    # -- the local file ------------------------------------------------------------------

    def _open(self) -> _File:
        """The copy, open; a copy the cache deleted meanwhile starts again, empty."""
        with self._lock:
            try:
                ino = os.stat(self.path).st_ino
            except FileNotFoundError:
                ino = -1
            if self._file is not None and ino == self._file.ino:
                return self._file
            self._file = None
            self._have = Intervals()
            if ino == -1:
                self.log_path.unlink(missing_ok=True)  # a log of a deleted copy describes nothing
            file = _File(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644))
            if os.fstat(file.fd).st_size != self.size:
                os.ftruncate(file.fd, self.size)  # sparse: no block is allocated until written
            try:
                records = self.log_path.read_bytes()
            except FileNotFoundError:
                records = b""
            for start, length in _RECORD.iter_unpack(records[: len(records) - len(records) % _RECORD.size]):
                if start + length <= self.size:
                    self._have.add(start, start + length)
            self._file = file
            return file

    def _write(self, file: _File, blobs: list[tuple[int, bytes]]) -> None:
        records = bytearray()
        fd = file.fd
        try:
            blocks = os.fstat(fd).st_blocks
            for start, blob in blobs:
                if blob and start + len(blob) <= self.size:
                    os.pwrite(fd, blob, start)
                    records += _RECORD.pack(start, len(blob))
            written = (os.fstat(fd).st_blocks - blocks) * 512  # what the disk gave (whole blocks)
            if records:
                with self._lock:
                    if self._file is not file:
                        return  # the copy was deleted and reopened meanwhile: these bytes went with it
                    with open(self.log_path, "ab") as fh:  # after the data: a crash costs a refetch
                        fh.write(records)
                    for start, length in _RECORD.iter_unpack(bytes(records)):
                        self._have.add(start, start + length)
        except OSError as exc:
            self._give_up(exc, [])
            return
        if written > 0 and self._on_write is not None:
            self._on_write(written)

    def _give_up(self, exc: OSError, ranges: list[tuple[int, int]]) -> tuple[list[bytes], int, int]:
        if not self._broken:
            log.warning("the disk tier at %s failed (%s); reading ranges from the store", self.path, exc)
        self._broken = True
        return self._fetch(ranges) if ranges else ([], 0, 0)
