"""A bytewax flow for ``test_recovery``: keyed counts over a replayable source, a sink that
can hang in its snapshot (so an epoch never finishes), and a source that can stay quiet for
its first polls (so the first epochs of a run finish empty).

Run as ``python -m tests.pipelines.epochs_flow RECOVERY_DIR OUT_FILE BLOCK_AFTER QUIET_S``.
Each output line is ``key j count``; a correct resume keeps ``count == j // 5 + 1``.
"""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import bytewax.operators as op
from bytewax.dataflow import Dataflow
from bytewax.inputs import FixedPartitionedSource, StatefulSourcePartition
from bytewax.outputs import FixedPartitionedSink, StatefulSinkPartition

ITEMS = 300


class _Part(StatefulSourcePartition[tuple[str, int], int]):
    def __init__(self, name: str, resume: int | None, quiet_s: float) -> None:
        self.name, self.i, self.quiet_s = name, resume or 0, quiet_s
        self.start: float | None = None

    def next_batch(self) -> list[tuple[str, int]]:
        self.start = self.start or time.monotonic()
        if time.monotonic() - self.start < self.quiet_s:
            return []
        if self.i >= ITEMS:
            raise StopIteration()
        batch = [(f"{self.name}-{j % 5}", j) for j in range(self.i, min(ITEMS, self.i + 7))]
        self.i += len(batch)
        return batch

    def next_awake(self) -> datetime:
        return datetime.now(UTC) + timedelta(milliseconds=20)

    def snapshot(self) -> int:
        return self.i


class _Source(FixedPartitionedSource[tuple[str, int], int]):
    def __init__(self, quiet_s: float) -> None:
        self.quiet_s = quiet_s

    def list_parts(self) -> list[str]:
        return ["p0", "p1"]

    def build_part(self, step_id: str, for_part: str, resume_state: int | None) -> _Part:
        return _Part(for_part, resume_state, self.quiet_s)


class _SinkPart(StatefulSinkPartition[tuple[str, int, int], int]):
    def __init__(self, out: Path, block_after: int, resume: int | None) -> None:
        self.out, self.block_after, self.n = out, block_after, resume or 0

    def write_batch(self, items: list[tuple[str, int, int]]) -> None:
        with self.out.open("a") as fh:
            fh.writelines(f"{key} {j} {count}\n" for key, j, count in items)
        self.n += len(items)

    def snapshot(self) -> int:
        if self.block_after and self.n >= self.block_after:
            time.sleep(3600)  # this epoch never finishes; the test kills the process
        return self.n


class _Sink(FixedPartitionedSink[tuple[str, int, int], int]):
    def __init__(self, out: Path, block_after: int) -> None:
        self.out, self.block_after = out, block_after

    def list_parts(self) -> list[str]:
        return ["s"]

    def part_fn(self, item_key: str) -> int:
        return 0

    def build_part(self, step_id: str, for_part: str, resume_state: int | None) -> _SinkPart:
        return _SinkPart(self.out, self.block_after, resume_state)


def _count(state: int | None, j: int) -> tuple[int, tuple[int, int]]:
    state = (state or 0) + 1
    return state, (j, state)


def flow(out: Path, block_after: int, quiet_s: float) -> Dataflow:
    df = Dataflow("epochs")
    counted = op.stateful_map("count", op.input("in", df, _Source(quiet_s)), _count)
    rows: Any = op.map("row", counted, lambda kv: (kv[0], (kv[0], *kv[1])))
    op.output("out", rows, _Sink(out, block_after))
    return df


if __name__ == "__main__":
    from bytewax._bytewax import cli_main
    from bytewax.recovery import RecoveryConfig

    recovery, out, block_after, quiet_s = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    cli_main(
        flow(out, block_after, quiet_s),
        workers_per_process=1,
        epoch_interval=timedelta(seconds=0.2),
        recovery_config=RecoveryConfig(recovery),
    )
