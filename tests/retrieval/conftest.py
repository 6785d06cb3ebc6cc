"""Fixtures shared by the retrieval tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.lake import Lake
from retrieval.audit import AuditLog


@pytest.fixture
def audit(tmp_path: Path) -> AuditLog:
    """A running audit log over a fresh lake, writing every 50 ms."""
    log = AuditLog(Lake.at(str(tmp_path / "lake")), flush_s=0.05, dead_letter_path=tmp_path / "audit-dead.jsonl")
    log.start()
    return log
