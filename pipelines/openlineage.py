"""OpenLineage run events (START / COMPLETE / FAIL) for the ingest job and index builds.

Data catalogs (Marquez, DataHub, …) then show which Kafka topics feed which lake tables
and which lake version each index version was built from. Where events go:

    --openlineage off                      nothing
    --openlineage file:/path/events.jsonl  one JSON event per line (the default:
                                           $XDG_STATE_HOME/streamrag/openlineage.jsonl)
    --openlineage http://marquez:5000      POSTed to <url>/api/v1/lineage

(also from ``STREAMRAG_OPENLINEAGE``). Emitting never fails the job: a lost event is
logged as a warning.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from openlineage.client import OpenLineageClient
from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
from openlineage.client.facet_v2 import (
    dataset_version_dataset,
    error_message_run,
    job_type_job,
)
from openlineage.client.transport.file import FileConfig, FileTransport
from openlineage.client.transport.http import HttpConfig, HttpTransport
from openlineage.client.transport.noop import NoopConfig, NoopTransport
from openlineage.client.transport.transport import Transport
from openlineage.client.uuid import generate_new_uuid

from pipelines.storage import normalize_uri

log = logging.getLogger(__name__)

NAMESPACE = "streamrag"
PRODUCER = "https://github.com/streamrag/streamrag"


def default_target() -> str:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return os.environ.get("STREAMRAG_OPENLINEAGE") or f"file:{Path(state) / 'streamrag' / 'openlineage.jsonl'}"


def transport_for(target: str) -> Transport:
    """``off``, ``file:PATH`` (or a plain path) or an ``http(s)://`` URL."""
    if target == "off":
        return NoopTransport(NoopConfig())
    if target.startswith(("http://", "https://")):
        # Few quick retries: an unreachable catalog must not hold up the job for long.
        retry = {"total": 2, "read": 2, "connect": 2, "backoff_factor": 0.2, "status_forcelist": [500, 502, 503, 504],
                 "allowed_methods": ["HEAD", "POST"]}  # fmt: skip
        return HttpTransport(HttpConfig.from_dict({"type": "http", "url": target.rstrip("/"), "timeout": 3,
                                                   "retry": retry}))  # fmt: skip
    path = Path(target.removeprefix("file:")).expanduser()
    if not str(path):
        raise ValueError("--openlineage file: needs a path, e.g. file:/var/log/streamrag/openlineage.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileTransport(FileConfig(log_file_path=str(path), append=True))


@dataclass(frozen=True)
class Dataset:
    namespace: str
    name: str
    version: str | None = None


def kafka_topic(bootstrap: str, topic: str) -> Dataset:
    """A topic, named as the OpenLineage spec names Kafka datasets."""
    first = bootstrap.split(",")[0].strip()
    return Dataset(f"kafka://{first}", topic)


def storage(uri: str, version: str | None = None) -> Dataset:
    """A Delta table or index store: ``s3://bucket`` + key path, or ``file`` + absolute path."""
    uri = normalize_uri(uri)
    parsed = urlparse(uri)
    if parsed.scheme in ("s3", "s3a"):
        return Dataset(f"s3://{parsed.netloc}", parsed.path.lstrip("/") or "/", version)
    return Dataset("file", parsed.path if parsed.scheme == "file" else uri, version)


class LineageRun:
    """One run of a job: ``start()``, then ``complete()`` or ``fail(exc)``."""

    def __init__(self, job: str, target: str | None = None, integration: str = "STREAMRAG",
                 processing: str = "BATCH") -> None:  # fmt: skip
        self.job = job
        self.run_id = str(generate_new_uuid())
        self.integration = integration
        self.processing = processing
        self.target = target or default_target()
        self._client: OpenLineageClient | None = None
        try:
            self._client = OpenLineageClient(transport=transport_for(self.target))
        except Exception as exc:  # noqa: BLE001 - lineage never stops the job
            log.warning("OpenLineage disabled: cannot use %s (%s)", self.target, exc)

    def _emit(self, state: RunState, inputs: list[Dataset], outputs: list[Dataset],
              run_facets: dict[str, Any] | None = None) -> None:  # fmt: skip
        if self._client is None:
            return
        job_facets: dict[str, Any] = {"jobType": job_type_job.JobTypeJobFacet(self.processing, self.integration, "JOB")}
        event = RunEvent(
            eventType=state,
            eventTime=datetime.now(UTC).isoformat(),
            run=Run(runId=self.run_id, facets=run_facets or {}),
            job=Job(namespace=NAMESPACE, name=self.job, facets=job_facets),
            inputs=[InputDataset(d.namespace, d.name, facets=_version(d)) for d in inputs],
            outputs=[OutputDataset(d.namespace, d.name, facets=_version(d)) for d in outputs],
            producer=PRODUCER,
        )
        try:
            self._client.emit(event)
        except Exception as exc:  # noqa: BLE001 - lineage never stops the job
            log.warning("OpenLineage %s event of %s not delivered to %s: %s", state.value, self.job, self.target, exc)

    def start(self, inputs: list[Dataset], outputs: list[Dataset]) -> None:
        self._emit(RunState.START, inputs, outputs)

    def complete(self, inputs: list[Dataset], outputs: list[Dataset]) -> None:
        self._emit(RunState.COMPLETE, inputs, outputs)

    def fail(self, inputs: list[Dataset], outputs: list[Dataset], error: BaseException | str) -> None:
        if isinstance(error, BaseException):
            message = str(error) or type(error).__name__
            stack = "".join(traceback.format_exception(error))
        else:
            message, stack = error, None
        facet = error_message_run.ErrorMessageRunFacet(message, "python", stack)
        self._emit(RunState.FAIL, inputs, outputs, {"errorMessage": facet})


def _version(d: Dataset) -> dict[str, Any]:
    if d.version is None:
        return {}
    return {"version": dataset_version_dataset.DatasetVersionDatasetFacet(d.version)}
