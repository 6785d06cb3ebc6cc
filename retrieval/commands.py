"""CLI: ``streamrag serve`` (the HTTP API) and ``streamrag search`` (the same engine, in-process)."""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from pipelines.storage import ObjectStoreSettings
from serving.process import bind_error

log = logging.getLogger(__name__)

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lake", required=True, metavar="URI")
    p.add_argument("--index", required=True, metavar="URI")
    p.add_argument("--model", help="query embedder: the index's model directory (default: bundled all-MiniLM-L6-v2)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--nprobe", type=int, help="IVF lists probed per query (default 16%% of the lists, 32 to 128)")
    p.add_argument("--cache-dir", type=Path, help="disk cache for shards (default ~/.cache/streamrag/shards)")
    p.add_argument("--cache-memory-mb", type=int, default=2048, help="shards held in memory (2048 MB)")
    p.add_argument("--cache-disk-mb", type=int, default=20480, help="shard files kept on disk (20480 MB)")


def add_commands(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the retrieval HTTP API")
    _engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="listen address (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tokens", type=Path, metavar="FILE", help="bearer tokens → principal and groups (YAML/JSON)")
    p.add_argument("--tail-poll", type=float, default=0.5, help="seconds between polls of the lake (0.5)")
    p.add_argument("--index-poll", type=float, default=5.0, help="seconds between checks for a new index (5)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("search", help="search from the command line (same engine as the API)")
    p.add_argument("query")
    _engine_args(p)
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--groups", default="", help="comma-separated groups of the caller (default: public only)")
    p.add_argument("--as-of", type=int, help="answer as of this lake version")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_search)


def _engine(args: argparse.Namespace, tail_poll: float = 0.5, index_poll: float = 5.0) -> Any:
    from indexing.store import open_store
    from pipelines.lake import Lake
    from retrieval.cache import ShardCache, default_cache_dir
    from retrieval.engine import EngineOptions, SearchEngine
    from serving.embedder import load_embedder

    if args.nprobe is not None and args.nprobe < 1:
        raise ValueError("--nprobe must be at least 1.")
    settings = ObjectStoreSettings.from_env()
    cache = ShardCache(
        args.cache_dir or default_cache_dir(), args.cache_memory_mb << 20, args.cache_disk_mb << 20
    )  # fmt: skip
    options = EngineOptions(
        nprobe=args.nprobe, tail_poll_s=tail_poll, index_poll_s=index_poll, prefetch_bytes=args.cache_memory_mb << 20
    )
    embedder = load_embedder(args.model, device=args.device)
    return SearchEngine(Lake.at(args.lake, settings), open_store(args.index, settings), embedder, cache, options)


def cmd_search(args: argparse.Namespace) -> int:
    from retrieval.engine import Principal

    engine = _engine(args)
    engine.start(background=False)
    groups = frozenset(g.strip() for g in args.groups.split(",") if g.strip())
    result = engine.search(args.query, args.k, Principal("cli", groups), args.as_of)
    if args.json:
        print(json.dumps({"results": result.results, "index_version": result.index_version,
                          "lake_version": result.lake_version}))  # fmt: skip
        return 0
    print(f"index version {result.index_version}, lake version {result.lake_version}:")
    for rank, r in enumerate(result.results, 1):
        snippet = " ".join(r["text"].split())[:160]
        print(f"{rank:>3}. {r['score']:.3f}  {r['doc_id']}  [{r['origin']}]  {r['title'] or ''}\n     {snippet}")
    if not result.results:
        print("no results visible to this caller.")
    return 0


def _load_in_background(engine: Any, stop: threading.Event) -> None:
    """Start the engine, retrying while there is no index yet or its store is unreachable."""
    reported = None
    while not stop.is_set():
        try:
            engine.start()
            return
        except Exception as exc:  # noqa: BLE001 - not ready: say why once, keep trying
            if str(exc) != reported:
                log.warning("not ready (retrying every 5 s): %s", exc)
                reported = str(exc)
        stop.wait(5)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from retrieval.api import create_app
    from retrieval.auth import Tokens

    problem = bind_error(args.host, args.port)
    if problem is not None:
        raise ValueError(f"cannot listen on {args.host}:{args.port} ({problem.strerror}); pick another --port.")
    tokens = Tokens.load(args.tokens) if args.tokens else None
    if tokens is None and args.host not in LOOPBACK:
        raise ValueError(f"refusing to listen on {args.host} without --tokens: anyone could search. "
                         "Give --tokens FILE, or serve on 127.0.0.1.")  # fmt: skip
    if tokens is None:
        log.warning("authentication is off (no --tokens): every caller is 'anonymous' and sees public documents only")
    else:
        log.info("authentication on: %d tokens", len(tokens))
    engine = _engine(args, args.tail_poll, args.index_poll)
    stop = threading.Event()
    loader = threading.Thread(target=_load_in_background, args=(engine, stop), name="engine-loader", daemon=True)
    loader.start()
    app = create_app(engine, tokens)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    t0 = time.monotonic()
    try:
        server.run()
    finally:
        stop.set()
        engine.stop()
    log.info("stopped after %.0f s", time.monotonic() - t0)
    return 0 if server.started else 1
