"""One client searching in a loop, in a process of its own (the freshness benchmark's load).

    python -m benchmarks.search_client URL ROUTE --seed 5 --k 10 < queries

Reads the queries from its stdin's first line (a JSON list of strings), prints ``ready``,
searches until its stdin closes, then prints one JSON object: each search's latency as the
client saw it (``latencies_s``) and, where the service reports it (``took_ms`` in
``/v1/search``'s answer), its own time (``server_ms``).

A process of its own because the benchmark's process also sends the changes (a pool of
threads producing to Kafka and, when changes are timed, searching for them): a searching
thread there waited for the GIL behind them, and that wait was counted as the service's
latency while updates flowed, not while idle.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("route")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args()
    queries = json.loads(sys.stdin.readline())
    print("ready", flush=True)
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    rng = random.Random(args.seed)
    latencies: list[float] = []
    server: list[float] = []
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = http.post(f"{args.url}{args.route}", json={"query": rng.choice(queries), "k": args.k})
            r.raise_for_status()
            body = r.json()
            latencies.append(time.perf_counter() - t0)
            if isinstance(body, dict) and isinstance(body.get("took_ms"), (int, float)):
                server.append(float(body["took_ms"]))
    json.dump({"latencies_s": latencies, "server_ms": server}, sys.stdout)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
