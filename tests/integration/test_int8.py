"""The int8 embedder end to end: an int8 lake and index are searched with int8 queries only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.lake import CHUNKS, Lake
from tests.integration.helpers import cli, ingest_args, produce
from tests.integration.test_serve import TOPICS, doc_events

pytestmark = pytest.mark.integration


def test_an_int8_index_is_served_by_int8_queries_and_refused_to_fp32_ones(broker: str, tmp_path: Path) -> None:
    topic = "cdc.app.public.docs_int8"
    rows = [(i + 1, t.title(), body, "") for i, (t, body) in enumerate(TOPICS)]
    produce(broker, topic, doc_events(100, rows), tmp_path / "events.jsonl")
    lake, index = str(tmp_path / "lake"), str(tmp_path / "index")
    out = cli(*ingest_args(broker, topic, lake, tmp_path / "recovery", idle=3), "--dtype", "int8")
    assert out.returncode == 0, out.stderr[-3000:]
    models = set(Lake.at(lake).table(CHUNKS).to_pyarrow_table(columns=["model"]).column("model").to_pylist())
    assert len(models) == 1 and "+int8@" in models.pop()
    out = cli("index", "build", "--lake", lake, "--index", index, "--nlist", "2", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]

    search = ["search", "--lake", lake, "--index", index, "--cache-dir", str(tmp_path / "cache"), "--json"]
    out = cli(*search, "--dtype", "int8", "molten rock and ash erupting", "-k", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["results"][0]["title"] == "Volcano"
    out = cli(*search, "molten rock and ash erupting")  # fp32 queries against int8 vectors: refused, not wrong
    assert out.returncode != 0 and "--dtype int8" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
