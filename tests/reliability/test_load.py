"""Load: `streamrag serve` under 16 concurrent loopback clients (5 minutes by default).

Zero errors, p99 stable (the last minute's p99 within 3x the first minute's) and memory
bounded (RSS at the end within 30% of RSS after the first minute, when caches are warm).
STREAMRAG_LOAD_SECONDS shortens or lengthens the run. The figures are printed (run with
-s to see them) and belong in the closing note, not in assertions about speed.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.integration.test_serve import BOB, TOPICS, Service, service  # noqa: F401 - the fixture

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

CLIENTS = 16
SECONDS = float(os.environ.get("STREAMRAG_LOAD_SECONDS", "300"))


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))] if ordered else 0.0


def serve_process(url: str) -> psutil.Process:
    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return psutil.Process(conn.pid)
    raise AssertionError(f"no process listens on {port}")


def test_sixteen_clients_for_minutes_zero_errors_stable_p99_bounded_memory(service: Service) -> None:  # noqa: F811
    proc = serve_process(service.url)
    queries = [body for _, body in TOPICS] + [f"{t} facts" for t, _ in TOPICS]
    samples: list[tuple[float, float, int]] = []  # (time since start, latency, status)
    rss: list[tuple[float, int]] = []
    lock = threading.Lock()
    start = time.monotonic()
    stop = start + SECONDS

    def client(i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(timeout=30, headers={"Authorization": BOB}) as http:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                try:
                    status = http.post(
                        f"{service.url}/v1/search", json={"query": rng.choice(queries), "k": 5}
                    ).status_code
                except httpx.HTTPError:
                    status = 0
                with lock:
                    samples.append((time.monotonic() - start, time.perf_counter() - t0, status))

    def watch() -> None:
        while time.monotonic() < stop:
            rss.append((time.monotonic() - start, sum(p.memory_info().rss for p in [proc, *proc.children(True)])))
            time.sleep(2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, range(CLIENTS)))
    watcher.join(5)

    errors = [s for s in samples if s[2] != 200]
    window = min(60.0, SECONDS / 5)
    first = [lat for t, lat, _ in samples if t < window]
    last = [lat for t, lat, _ in samples if t > SECONDS - window]
    warm_rss = next(r for t, r in rss if t >= window) if any(t >= window for t, _ in rss) else rss[0][1]
    p50 = sorted(lat for _, lat, _ in samples)[len(samples) // 2]
    figures = {
        "clients": CLIENTS, "seconds": SECONDS, "requests": len(samples), "errors": len(errors),
        "rps": round(len(samples) / SECONDS, 1), "p50_ms": round(p50 * 1000, 1),
        "p99_first_ms": round(p99(first) * 1000, 1), "p99_last_ms": round(p99(last) * 1000, 1),
        "rss_warm_mb": warm_rss >> 20, "rss_end_mb": rss[-1][1] >> 20, "rss_max_mb": max(r for _, r in rss) >> 20,
    }  # fmt: skip
    print(json.dumps({"bench": "api_load", **figures}))
    assert not errors, f"{len(errors)} failed requests, e.g. status {errors[0][2]}"
    assert p99(last) <= 3 * max(p99(first), 0.05), figures
    assert rss[-1][1] <= 1.3 * warm_rss, figures
