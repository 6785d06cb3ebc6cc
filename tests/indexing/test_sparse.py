"""The disk tier of ranged reads: what was read once is read from disk, across restarts,
and nothing on disk is trusted past its check."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from indexing.sparse import Intervals, SparseCopy

DATA = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()


class Remote:
    """A remote file that counts the ranges read from it."""

    def __init__(self) -> None:
        self.reads: list[tuple[int, int]] = []

    def __call__(self, ranges: list[tuple[int, int]]) -> tuple[list[bytes], int, int]:
        self.reads += ranges
        blobs = [DATA[s : s + n] for s, n in ranges]
        return blobs, len(ranges), sum(map(len, blobs))


def test_intervals_merge_and_cover() -> None:
    have = Intervals()
    for start, end in [(10, 20), (30, 40), (20, 25), (50, 60), (24, 31)]:
        have.add(start, end)
    assert list(zip(have.starts, have.ends, strict=True)) == [(10, 40), (50, 60)]
    assert have.covers(10, 40) and have.covers(12, 13) and have.covers(50, 60)
    assert not have.covers(5, 12) and not have.covers(39, 41) and not have.covers(45, 46) and not have.covers(55, 61)
    have.add(0, 100)
    assert list(zip(have.starts, have.ends, strict=True)) == [(0, 100)] and have.total == 100


def test_a_range_read_once_comes_from_disk_after_that_and_after_a_restart(tmp_path: Path) -> None:
    remote = Remote()
    path = tmp_path / "f.part"
    disk_reads: list[int] = []
    copy = SparseCopy(path, len(DATA), remote, on_disk_read=disk_reads.append)
    ranges = [(100, 50), (4096 * 10, 4096), (len(DATA) - 7, 7)]
    got, requests, nbytes = copy(ranges)
    assert got == [DATA[s : s + n] for s, n in ranges] and requests == 3 and nbytes == 50 + 4096 + 7
    got, requests, nbytes = copy([*ranges, (120, 10)])  # inside a range already read
    assert got[-1] == DATA[120:130] and (requests, nbytes) == (0, 0) and disk_reads == [4]
    assert os.stat(path).st_blocks * 512 < len(DATA) // 4, "the copy is sparse: only what was read takes disk"
    restarted = SparseCopy(path, len(DATA), remote)
    assert restarted.read_local([*ranges, (120, 10)]) == [DATA[s : s + n] for s, n in [*ranges, (120, 10)]]
    assert restarted.read_local([*ranges, (99, 2)]) is None, "a range the copy lacks: nothing, and no fetch"
    assert len(remote.reads) == 3
    got, requests, _ = restarted(ranges)
    assert got == [DATA[s : s + n] for s, n in ranges] and requests == 0
    got, requests, _ = restarted([(99, 2)])  # one byte before what is on disk: fetched
    assert got == [DATA[99:101]] and requests == 1


def test_fresh_reads_past_the_disk_and_repairs_it(tmp_path: Path) -> None:
    remote = Remote()
    path = tmp_path / "f.part"
    copy = SparseCopy(path, len(DATA), remote)
    copy([(0, 1000)])
    with open(path, "r+b") as fh:  # the disk rots under the copy
        fh.seek(10)
        fh.write(b"\x00" * 20)
    bad, requests, _ = copy([(0, 1000)])
    assert requests == 0 and bad[0] != DATA[:1000], "the disk is read as it is: the caller's check decides"
    good, requests, _ = copy([(0, 1000)], fresh=True)
    assert good == [DATA[:1000]] and requests == 1
    assert copy([(0, 1000)]) == ([DATA[:1000]], 0, 0), "the fresh read overwrote the rotten bytes"


def test_a_deleted_copy_starts_again_and_a_broken_disk_degrades_to_the_store(tmp_path: Path) -> None:
    remote = Remote()
    path = tmp_path / "f.part"
    copy = SparseCopy(path, len(DATA), remote)
    copy([(0, 100)])
    path.unlink()  # the cache trimmed it
    got, requests, _ = copy([(0, 100)])
    assert got == [DATA[:100]] and requests == 1 and path.exists()
    assert copy([(0, 100)])[1] == 0
    blocked = SparseCopy(tmp_path / "missing-dir" / "f.part", len(DATA), remote)
    got, requests, _ = blocked([(5, 5)])
    assert got == [DATA[5:10]] and requests == 1


@pytest.mark.parametrize("torn", [True, False])
def test_a_log_without_its_data_costs_a_refetch_not_a_wrong_answer(tmp_path: Path, torn: bool) -> None:
    """A crash between the data and the log: the log may name bytes never written (zeros)."""
    remote = Remote()
    path = tmp_path / "f.part"
    SparseCopy(path, len(DATA), remote)([(0, 64)])
    if torn:
        with open(path, "r+b") as fh:
            fh.write(b"\x00" * 64)
    got, requests, _ = SparseCopy(path, len(DATA), remote)([(0, 64)])
    assert requests == 0 and (got[0] != DATA[:64]) == torn  # what ResidentLists' check then refetches fresh
