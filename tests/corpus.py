"""Seeded Debezium corpora with an oracle: what the lake must hold after ingesting them."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.envelopes import envelope, produce_line

WORDS = (
    "kafka delta lake stream chunk vector index shard embed query lineage audit table row "
    "commit offset partition worker replica cache snapshot version schema topic broker "
    "consumer producer latency recall cluster centroid merge filter group access policy"
).split()


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
    return " ".join(words).capitalize() + "."


def paragraph(rng: random.Random) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(2, 4)))


def body(rng: random.Random, paragraphs: int) -> str:
    return "\n\n".join(paragraph(rng) for _ in range(paragraphs))


@dataclass
class Corpus:
    """Debezium lines plus the expected final documents and the malformed lines' count."""

    lines: list[str] = field(default_factory=list)
    #: primary key → (title, body, acl) of every document alive at the end
    expected: dict[str, tuple[str, str, tuple[str, ...]]] = field(default_factory=dict)
    malformed: int = 0
    stale: int = 0

    def write(self, path: Path) -> Path:
        path.write_text("\n".join(self.lines) + "\n")
        return path


def _event(op: str, pk: int, row: dict | None, before: dict | None, lsn: int, wrapped: bool = False) -> str:
    value = envelope(op, row, before, lsn=lsn, ts_ms=1_700_000_000_000 + lsn, wrapped=wrapped)  # type: ignore[arg-type]
    return produce_line({"id": pk}, value)


MALFORMED = [
    "this is not json at all",
    '{"op": "c", "after": {"id": 1}',  # truncated
    '{"before": null, "after": {"id": 5, "title": 7, "body": "x"}, "source": {"table": "docs", "lsn": 1}, "op": "c"}',
    '{"before": null, "after": null, "source": {"table": "docs", "lsn": 1}, "op": "c"}',
    '{"before": null, "after": {"title": "no id"}, "source": {"table": "docs", "lsn": 1}, "op": "c"}',
    '{"before": null, "after": {"id": 9}, "source": {"table": "docs", "lsn": 1}, "op": "z"}',
    "[1, 2, 3]",
    '{"before": null, "after": {"id": 8, "body": "b", "acl": {"bad": 1}}, '
    '"source": {"table": "docs", "lsn": 1}, "op": "c"}',
]


def make_corpus(
    seed: int = 7,
    docs: int = 40,
    paragraphs: int = 3,
    updates: int = 20,
    deletes: int = 6,
    groups: tuple[str, ...] = ("eng", "ops", "sales"),
) -> Corpus:
    """Inserts, one-paragraph updates, deletes (+ tombstones), late stale updates, garbage."""
    rng = random.Random(seed)
    corpus = Corpus()
    lsn = 100
    state: dict[int, dict] = {}
    late: list[str] = []
    for pk in range(1, docs + 1):
        acl = ",".join(rng.sample(groups, rng.randint(1, 2))) if rng.random() < 0.3 else ""
        row = {"id": pk, "title": f"Doc {pk}", "body": body(rng, paragraphs), "acl": acl}
        lsn += 10
        corpus.lines.append(_event("r" if pk % 2 else "c", pk, row, None, lsn, wrapped=pk % 3 == 0))
        state[pk] = row
    live = sorted(state)
    for i in range(updates):
        pk = rng.choice(live)
        old = state[pk]
        paras = old["body"].split("\n\n")
        paras[rng.randrange(len(paras))] = paragraph(rng)
        row = {**old, "body": "\n\n".join(paras)}
        if i % 5 == 0:
            row["acl"] = rng.choice(groups)
        lsn += 10
        # A stale copy of an older version, delivered after the newer one.
        late.append(_event("u", pk, {**old, "body": "STALE " + old["body"]}, old, lsn - 5))
        corpus.lines.append(_event("u", pk, row, old, lsn))
        state[pk] = row
    for pk in rng.sample(live, deletes):
        lsn += 10
        corpus.lines.append(_event("d", pk, None, state[pk], lsn))
        corpus.lines.append(json.dumps({"key": {"id": pk}, "value": None}))  # tombstone
        del state[pk]
    corpus.lines.extend(late)
    corpus.stale = len(late)
    for i, bad in enumerate(MALFORMED):
        corpus.lines.insert(5 + 7 * i, bad)
    corpus.malformed = len(MALFORMED)
    corpus.expected = {
        str(pk): (r["title"], r["body"], tuple(sorted(g for g in r["acl"].split(",") if g))) for pk, r in state.items()
    }
    return corpus
