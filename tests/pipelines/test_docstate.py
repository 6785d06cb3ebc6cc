from __future__ import annotations

import random

import pytest

from pipelines.chunking import Chunker
from pipelines.docstate import apply_change
from pipelines.records import ChangeEvent, KafkaCoordinates
from serving.fake_embedder import FakeEmbedder
from tests.corpus import paragraph


@pytest.fixture
def chunker() -> Chunker:
    return Chunker(FakeEmbedder().count_tokens, max_tokens=80, overlap_tokens=16)


def event(
    pos: int | None,
    text: str = "",
    op: str = "upsert",
    acl: tuple[str, ...] = (),
    tombstone: bool = False,
    title: str = "T",
) -> ChangeEvent:
    return ChangeEvent(
        "public.docs",
        "1",
        op,
        None if pos is None else f"pg:{pos:020d}",  # type: ignore[arg-type]
        KafkaCoordinates("t", 0, pos or 0),
        1000,
        title,
        text,
        acl,
        tombstone=tombstone,
    )


def doc(seed: int, n: int = 20) -> list[str]:
    rng = random.Random(seed)
    return [paragraph(rng) for _ in range(n)]


def test_insert_then_local_edit_reembeds_only_changed_chunks(chunker: Chunker) -> None:
    paras = doc(1)
    state, update, outcome = apply_change(None, event(10, "\n\n".join(paras)), chunker)
    assert outcome == "applied" and update is not None and state is not None
    first = {v.chunk_id for v in update.versions}
    assert all(v.op == "upsert" for v in update.versions) and len(first) == len(state.chunks)

    paras[7] = paragraph(random.Random(42))
    state2, update2, _ = apply_change(state, event(20, "\n\n".join(paras)), chunker)
    assert update2 is not None and state2 is not None
    upserts = [v for v in update2.versions if v.op == "upsert"]
    deletes = [v for v in update2.versions if v.op == "delete"]
    new_content = [v for v in upserts if v.content_hash not in {h for _, h in state.chunks.values()}]
    moved = [v for v in upserts if v not in new_content]
    assert 1 <= len(new_content) <= 3 and len(new_content) < len(state2.chunks) / 2  # all that is embedded
    assert all(state.chunks[v.chunk_id][0] != v.chunk_index for v in moved)
    assert {v.chunk_id for v in deletes} <= first
    assert set(state2.chunks) == (first - {v.chunk_id for v in deletes}) | {v.chunk_id for v in upserts}


def test_stale_and_duplicate_changes_are_ignored(chunker: Chunker) -> None:
    state, _, _ = apply_change(None, event(10, "new text"), chunker)
    assert apply_change(state, event(5, "old text"), chunker)[1:] == (None, "stale")
    assert apply_change(state, event(10, "new text"), chunker)[1:] == (None, "stale")


def test_same_text_again_writes_nothing(chunker: Chunker) -> None:
    state, _, _ = apply_change(None, event(10, "Some text."), chunker)
    new_state, update, outcome = apply_change(state, event(11, "Some text."), chunker)
    assert (update, outcome) == (None, "unchanged") and new_state is not None and new_state.position.endswith("11")


def test_acl_change_rewrites_every_chunk_without_deletes(chunker: Chunker) -> None:
    state, _, _ = apply_change(None, event(10, "\n\n".join(doc(2))), chunker)
    _, update, _ = apply_change(state, event(11, "\n\n".join(doc(2)), acl=("eng",)), chunker)
    assert update is not None and {v.op for v in update.versions} == {"upsert"}
    assert len(update.versions) == len(state.chunks) and all(v.acl == ("eng",) for v in update.versions)


def test_delete_then_tombstone_then_late_update(chunker: Chunker) -> None:
    state, _, _ = apply_change(None, event(10, "\n\n".join(doc(3))), chunker)
    deleted, update, _ = apply_change(state, event(20, op="delete"), chunker)
    assert update is not None and {v.op for v in update.versions} == {"delete"}
    assert {v.chunk_id for v in update.versions} == set(state.chunks)
    assert apply_change(deleted, event(None, tombstone=True, op="delete"), chunker)[1:] == (None, "tombstone")
    assert apply_change(deleted, event(15, "late"), chunker)[1:] == (None, "stale")
    # Re-inserted after the delete: everything is new again.
    _, again, _ = apply_change(deleted, event(30, "back"), chunker)
    assert again is not None and [v.op for v in again.versions] == ["upsert"]


def test_tombstone_alone_deletes_a_live_document(chunker: Chunker) -> None:
    state, _, _ = apply_change(None, event(10, "text"), chunker)
    new_state, update, _ = apply_change(state, event(None, tombstone=True, op="delete"), chunker)
    assert update is not None and [v.op for v in update.versions] == ["delete"]
    assert new_state is not None and new_state.position > state.position
    assert update.versions[0].position > state.position


def test_a_replayed_delete_and_its_tombstone_leave_the_re_created_row(chunker: Chunker) -> None:
    """A source that restarts re-sends delete, tombstone, re-create, delete, tombstone: the
    second delete is stale, and its tombstone must not delete the re-created row (the bug
    a kill -9 of the Postgres source found)."""
    tombstone = event(None, tombstone=True, op="delete")
    state, _, _ = apply_change(None, event(10, "first life"), chunker)
    state, _, _ = apply_change(state, event(20, op="delete"), chunker)
    state, _, _ = apply_change(state, tombstone, chunker)
    state, _, _ = apply_change(state, event(30, "second life"), chunker)
    for replayed in (event(20, op="delete"), tombstone, event(30, "second life")):  # the replay
        state, update, _ = apply_change(state, replayed, chunker)
        assert update is None and state is not None and state.live
    # a later tombstone alone (the delete compacted away) still deletes it
    state, update, _ = apply_change(state, tombstone, chunker)
    assert update is not None and [v.op for v in update.versions] == ["delete"]


def test_delete_of_unknown_document_writes_nothing_but_remembers_position(chunker: Chunker) -> None:
    state, update, _ = apply_change(None, event(10, op="delete"), chunker)
    assert update is None and state is not None and not state.live
    assert apply_change(state, event(9, "older insert"), chunker)[2] == "stale"


def test_repeated_paragraphs_get_distinct_ids(chunker: Chunker) -> None:
    same = "A repeated heading paragraph that stands alone."
    text = "\n\n".join([same, *doc(4, 6), same, *doc(5, 6), same])
    _, update, _ = apply_change(None, event(10, text), chunker)
    assert update is not None and len({v.chunk_id for v in update.versions}) == len(update.versions)


def test_text_added_above_moves_the_chunks_below(chunker: Chunker) -> None:
    """Every live chunk's latest row carries its current position in the document."""
    paras = doc(3, n=8)
    state, _, _ = apply_change(None, event(10, "\n\n".join(paras)), chunker)
    assert state is not None
    inserted = [paragraph(random.Random(99)), *paras]
    state2, update, _ = apply_change(state, event(20, "\n\n".join(inserted)), chunker)
    assert update is not None and state2 is not None
    latest = {cid: index for cid, (index, _) in state.chunks.items()}
    latest.update({v.chunk_id: v.chunk_index for v in update.versions if v.op == "upsert"})
    for v in update.versions:
        if v.op == "delete":
            latest.pop(v.chunk_id, None)
    assert latest == {cid: index for cid, (index, _) in state2.chunks.items()}
    assert sorted(latest.values()) == list(range(len(state2.chunks)))
    same_text = [v for v in update.versions if v.op == "upsert" and v.chunk_id in state.chunks]
    assert same_text and all(v.content_hash == state.chunks[v.chunk_id][1] for v in same_text)


def test_chunks_removed_by_a_restricting_edit_carry_the_new_acl(chunker: Chunker) -> None:
    paras = doc(4, n=6)
    state, _, _ = apply_change(None, event(10, "\n\n".join(paras)), chunker)
    _, update, _ = apply_change(state, event(20, "\n\n".join(paras[:2]), acl=("hr",)), chunker)
    assert update is not None and any(v.op == "delete" for v in update.versions)
    assert all(v.acl == ("hr",) for v in update.versions)


def test_metadata_travels_with_every_chunk_and_a_change_rewrites_them(chunker: Chunker) -> None:
    import dataclasses
    import json

    text = "\n\n".join(doc(5, n=4))
    tagged = dataclasses.replace(event(10, text), metadata=(("team", '"eng"'), ("year", "2026")))
    state, update, _ = apply_change(None, tagged, chunker)
    assert update is not None and state is not None
    assert {v.metadata for v in update.versions} == {json.dumps({"team": "eng", "year": 2026}, sort_keys=True)}
    assert apply_change(state, dataclasses.replace(tagged, position="pg:00000000000000000011"), chunker)[1] is None
    moved = dataclasses.replace(tagged, position="pg:00000000000000000012", metadata=(("team", '"ops"'),))
    _, update2, _ = apply_change(state, moved, chunker)
    assert update2 is not None and len(update2.versions) == len(state.chunks)
    assert all(v.op == "upsert" and v.metadata == '{"team": "ops"}' for v in update2.versions)
