"""Running the ingest dataflow: one process, or N processes as a Bytewax cluster.

``--workers N`` runs N processes on this machine (not threads: the GIL). The parent
supervises: a child that fails stops the others and the command exits non-zero; a
parent that dies takes its children with it (PR_SET_PDEATHSIG), so a kill -9 of the
job never leaves half a cluster behind. Restarting resumes from the recovery directory.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from bytewax._bytewax import cli_main
from bytewax.recovery import RecoveryConfig, init_db_dir

from pipelines import secrets
from pipelines.broker import die_with_parent, ensure_topics, free_port
from pipelines.kafka_io import KafkaIOError
from pipelines.lake import Lake
from pipelines.recovery import drop_unfinished_epochs
from pipelines.settings import IngestSettings
from serving.process import bind_error

log = logging.getLogger(__name__)

_SETTINGS_ENV = "STREAMRAG_INGEST_SETTINGS_JSON"


def prepare(settings: IngestSettings) -> IngestSettings:
    """Create lake tables and the recovery directory; honour the lake's writer count."""
    lake = Lake.at(settings.lake, settings.object_store())
    recorded = lake.ensure_tables(settings.writers)
    if recorded != settings.writers:
        log.info("lake %s was created with %d writers; using that", lake.uri, recorded)
        settings = settings.model_copy(update={"writers": recorded})
    if settings.recovery_dir:
        rdir = Path(settings.recovery_dir)
        rdir.mkdir(parents=True, exist_ok=True)
        if not any(rdir.glob("part-*.sqlite3")):
            init_db_dir(rdir, settings.workers)
        else:
            drop_unfinished_epochs(rdir)
    else:
        log.warning(
            "no --recovery-dir: every run re-reads the topics from the start "
            "(the lake stays exactly-once, but work is repeated)"
        )
    return settings


def ensure_dead_letter_topics(settings: IngestSettings) -> None:
    """Create ``<topic><suffix>`` for each input topic (as many partitions as the input).

    An input topic that does not exist yet is waited for, up to ``topic_wait_s``: a source
    started beside the job (``cdc postgres``, Debezium) creates its topics once it has
    connected, and a job that exits instead would be restarted in a loop by its supervisor.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": settings.bootstrap, **settings.kafka_config})
    deadline = time.monotonic() + settings.topic_wait_s
    waited = False
    while True:
        try:
            topics = admin.list_topics(timeout=15).topics
        except KafkaException as exc:
            reason = exc.args[0].str()
            raise KafkaIOError(f"cannot reach Kafka at {settings.bootstrap} ({reason}); is the broker up?") from exc
        missing = [t for t in settings.topics if t not in topics]
        if not missing:
            break
        if time.monotonic() >= deadline:
            waited_for = f" (waited {settings.topic_wait_s:g} s)" if settings.topic_wait_s else ""
            raise KafkaIOError(
                f"topic {missing[0]!r} does not exist on {settings.bootstrap}{waited_for}; "
                "produce to it or create it first."
            )
        if not waited:
            log.info("waiting up to %g s for topic(s) %s to be created", settings.topic_wait_s, ", ".join(missing))
            waited = True
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    for topic in settings.topics:
        partitions = len(topics[topic].partitions or {}) or 1
        ensure_topics(settings.bootstrap, [topic + settings.dlq_suffix], partitions=partitions)
    if settings.notices_topic:
        ensure_topics(settings.bootstrap, [settings.notices_topic], partitions=1)


def _recovery(settings: IngestSettings) -> RecoveryConfig | None:
    return RecoveryConfig(Path(settings.recovery_dir)) if settings.recovery_dir else None


def run_process(settings: IngestSettings, proc_id: int | None = None, addresses: list[str] | None = None) -> None:
    """Run this process's share of the dataflow until it completes."""
    from pipelines.flow import build_flow

    if settings.metrics_port is not None:
        from prometheus_client import start_http_server

        # Processes sharing a machine (--workers) take port + i; one per machine (pods) all use the port.
        offset = (proc_id or 0) if addresses is None or _all_local(addresses) else 0
        start_http_server(settings.metrics_port + offset, addr=settings.metrics_host)
    cli_main(
        build_flow(settings),
        workers_per_process=1,
        process_id=proc_id,
        addresses=addresses,
        epoch_interval=timedelta(seconds=settings.epoch_interval_s),
        recovery_config=_recovery(settings),
    )


def run_ingest(settings: IngestSettings) -> int:
    """Run the job (prepared first); return the exit status."""
    settings = prepare(settings)
    ensure_dead_letter_topics(settings)
    if settings.workers == 1:
        run_process(settings)
        return 0
    return _run_cluster(settings)


def _all_local(addresses: list[str]) -> bool:
    return all(a.startswith(("127.0.0.1:", "localhost:")) for a in addresses)


def run_member(settings: IngestSettings, process_id: int, addresses: list[str], wait_s: float = 300.0) -> int:
    """Run process ``process_id`` of a Bytewax cluster spread over machines (one pod each).

    Process 0 prepares the lake and the recovery directory (shared by all members, e.g. a
    ReadWriteMany volume); the others wait for it.
    """
    if not 0 <= process_id < len(addresses):
        raise ValueError(f"--process-id must be between 0 and {len(addresses) - 1} (one per --addresses entry).")
    if settings.workers != 1:
        raise ValueError("--workers is per machine; with --process-id each member runs one process.")
    settings = settings.model_copy(update={"workers": len(addresses)})
    if process_id == 0:
        settings = prepare(settings)
        ensure_dead_letter_topics(settings)
    elif settings.recovery_dir:
        deadline = time.monotonic() + wait_s
        while not any(Path(settings.recovery_dir).glob("part-*.sqlite3")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"process 0 did not initialise {settings.recovery_dir} within {wait_s:.0f} s.")
            time.sleep(1)
    run_process(settings.model_copy(update={"workers": 1}), process_id, addresses)
    return 0


#: a child's exit status when its cluster address was taken before it could listen on it
_EXIT_ADDRESS_IN_USE = 75
_CLUSTER_START_TRIES = 3


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def cluster_addresses(n: int) -> list[str]:
    """``n`` free loopback addresses for a local cluster's processes, below the ephemeral range.

    A port the kernel hands out as free (bind to 0) is an ephemeral port, and the processes
    connecting to their peers (and to Kafka) take ephemeral ports as their local ends: one
    could take a peer's port in the second between choosing it and that peer listening on
    it. Ports below the range are only ever taken by a listener that asks for them.
    """
    floor = _ephemeral_floor()
    low = 10_000 if floor > 11_000 else 1_024
    rng = random.SystemRandom()
    ports: list[int] = []
    for _ in range(100 * n if floor > low else 0):
        if len(ports) == n:
            break
        port = rng.randrange(low, floor)
        if port not in ports and bind_error("127.0.0.1", port) is None:
            ports.append(port)
    while len(ports) < n:  # no range below, or a crowded one: the kernel's choice (as before)
        if (port := free_port()) not in ports:
            ports.append(port)
    return [f"127.0.0.1:{p}" for p in ports]


def _run_cluster(settings: IngestSettings) -> int:
    """Run the cluster; start it again on other ports when a child could not listen on its own."""
    for _ in range(_CLUSTER_START_TRIES - 1):
        status = _run_cluster_once(settings, cluster_addresses(settings.workers))
        if status != _EXIT_ADDRESS_IN_USE:
            return status
        log.warning("a cluster address was taken before its process listened on it; starting again on other ports")
        if settings.recovery_dir:
            # the stopped processes may have begun an epoch: the same cleanup as after a crash
            drop_unfinished_epochs(Path(settings.recovery_dir))
    return _run_cluster_once(settings, cluster_addresses(settings.workers))


def _run_cluster_once(settings: IngestSettings, addresses: list[str]) -> int:
    env = {**os.environ, _SETTINGS_ENV: settings.model_dump_json()}
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "pipelines.runner", str(i), ";".join(addresses)],
            env=env,
            preexec_fn=die_with_parent(signal.SIGKILL),
        )
        for i in range(settings.workers)
    ]

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    # every child is polled each round: a generator in any() would stop at the first one
    # running, and the failure of a later one (whose peers then wait for it forever) would
    # go unseen
    first_failure = 0
    while None in [c.poll() for c in children]:
        failed = [c for c in children if c.returncode not in (None, 0)]
        if failed:
            first_failure = failed[0].returncode
            log.error(
                "ingest process %d exited with %s; stopping the others", children.index(failed[0]), failed[0].returncode
            )
            for c in children:
                if c.poll() is None:
                    c.kill()
            break
        time.sleep(0.2)
    codes = [c.wait() for c in children]
    if _EXIT_ADDRESS_IN_USE in codes:
        # a peer of the process that could not listen may fail too (a handshake with whatever
        # holds the port): the address is the cause to report
        return _EXIT_ADDRESS_IN_USE
    status = first_failure or next((code for code in codes if code != 0), 0)
    return 0 if status == 0 else (status if status > 0 else 1)


def _child_main() -> None:
    fmt = "%(asctime)s %(levelname)s [proc %(process)d] %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt)
    proc_id, addresses = int(sys.argv[1]), sys.argv[2].split(";")
    settings = IngestSettings.model_validate(json.loads(os.environ[_SETTINGS_ENV]))
    secrets.install(fmt)
    secrets.register(settings.s3_secret_access_key, settings.s3_session_token)
    secrets.register_config(settings.kafka_config)
    status = 0
    try:
        run_process(settings, proc_id, addresses)
    except KeyboardInterrupt:
        status = 130
    except Exception as exc:
        log.exception("ingest process %d failed", proc_id)
        # bytewax's words when another socket holds this process's cluster address
        status = _EXIT_ADDRESS_IN_USE if "failed to initialize networking: Address already in use" in str(exc) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    # deltalake's runtime threads can abort interpreter teardown (exit 134): leave directly.
    os._exit(status)


if __name__ == "__main__":
    _child_main()
