"""CLI: ``streamrag serve`` (the HTTP API), ``streamrag search`` (the same engine, in-process)
and ``streamrag lineage`` (audit queries over the lake)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from pipelines.commands import add_kafka_config_arg
from pipelines.settings import from_args
from pipelines.storage import ObjectStoreSettings
from retrieval.settings import EngineSettings, SearchSettings, ServeSettings
from serving.process import bind_error

log = logging.getLogger(__name__)

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lake", metavar="URI", help="the lake (required)")
    p.add_argument("--index", metavar="URI", help="the index store (required)")
    p.add_argument("--model", help="query embedder: the index's model directory (default: bundled all-MiniLM-L6-v2)")
    p.add_argument("--device", help="auto (default), cpu or cuda")
    p.add_argument("--dtype", help="query embedder precision: auto (default), fp32, bf16, fp16 or int8 (as ingest had)")
    p.add_argument(
        "--cpu-threads",
        type=int,
        help="threads for query embedding on CPU (default: every core; each query runs alone on one)",
    )
    p.add_argument("--nprobe", type=int, help="IVF lists probed per query (default 16%% of the lists, 32 to 128)")
    p.add_argument(
        "--rerank",
        type=int,
        help="a compressed index ranks RERANK × k candidates by their codes, then re-ranks them exactly with "
        "their float vectors fetched by range (sq8/sq4: 4, pqM: 10; 1: no re-ranking)",
    )
    p.add_argument("--cache-dir", type=Path, help="disk cache for shards (default ~/.cache/streamrag/shards)")
    p.add_argument("--cache-memory-mb", type=int, help="shards held in memory (2048 MB)")
    p.add_argument("--cache-disk-mb", type=int, help="shard files kept on disk (20480 MB)")
    p.add_argument(
        "--mode",
        choices=["hybrid", "dense", "keyword"],
        help="hybrid (default): keyword (BM25) and vector rankings fused (--fusion); dense: vectors only; "
        "keyword: BM25 only (serve: what a request that names no mode gets)",
    )
    p.add_argument(
        "--keyword-weight",
        type=float,
        help="hybrid: the keyword ranking's weight for a sentence; dense's is 1 (linear: 0.75, rrf: 0.1)",
    )
    p.add_argument(
        "--keyword-memory-mb",
        type=int,
        help="keyword working copies kept in memory (/dev/shm, twice their size counted) while they fit, so that "
        "adding each fresh update skips the disk's fsync; larger ones stay on disk; 0: all on disk (256)",
    )
    p.add_argument(
        "--identifier-weight",
        type=float,
        help="hybrid: the keyword ranking's weight for a query that is an identifier, not a sentence "
        "(os.replace, dirs_exist_ok, --user: at most three words, code-like) (linear: 3, rrf: 1.5)",
    )
    p.add_argument(
        "--code-weight",
        type=float,
        help="hybrid: the keyword ranking's weight for a sentence that holds a code-like token "
        "(what does os.replace do?); other sentences get --keyword-weight (linear: 2, rrf: 1.5)",
    )
    p.add_argument(
        "--fusion",
        choices=["rrf", "linear"],
        help="hybrid: linear (default): weights × scores min-max normalised per ranking; rrf: weight / (k + rank) "
        "per ranking. Either way a result's score shows only ranks (linear: 1 / its place), never BM25's",
    )
    p.add_argument("--rrf-k", type=int, help="hybrid: the constant k of weight / (k + rank) (10)")
    p.add_argument("--fusion-depth", type=int, help="hybrid: candidates fused from the dense ranking (100)")
    p.add_argument(
        "--keyword-depth",
        type=int,
        help="hybrid: candidates fused from the keyword ranking, at least k (15: chosen by benchmarks/quality.py)",
    )
    p.add_argument(
        "--feedback-docs",
        type=int,
        help="hybrid: pseudo-relevance feedback: the dense candidates are ranked by the query vector moved towards "
        "the mean vector of the N nearest of them (chunks the caller may see); 0: off (1)",
    )
    p.add_argument("--feedback-weight", type=float, help="hybrid: the feedback chunks' weight, the query's 1 (1.0)")


def _env_help(command: str) -> str:
    return (f"Every option can also be set as a variable STREAMRAG_{command.upper()}_<OPTION> "
            f"(STREAMRAG_{command.upper()}_NPROBE=64); flags win.")  # fmt: skip


def add_commands(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the retrieval HTTP API", description=_env_help("serve"))
    _engine_args(p)
    p.add_argument("--host", help="listen address (127.0.0.1)")
    p.add_argument("--port", type=int, help="(8000)")
    p.add_argument("--tokens", type=Path, metavar="FILE", help="bearer tokens → principal and groups (YAML/JSON)")
    p.add_argument(
        "--rate-limit",
        type=float,
        metavar="PER_S",
        help="requests/s per principal, bursts of twice that, 429 beyond (default 0: off; set it when exposed)",
    )
    p.add_argument(
        "--search-on-workers",
        action="store_true",
        default=None,
        help="run every search on a worker thread (default: on the event loop while all it needs is in memory)",
    )
    p.add_argument(
        "--tail-poll", type=float, help="seconds between polls of the lake (0.5; 2 when following commit notices)"
    )
    p.add_argument(
        "--bootstrap",
        help="Kafka bootstrap servers: follow the ingest job's commit notices and read each commit at once",
    )
    p.add_argument("--notices-topic", help="the ingest job's --notices-topic (streamrag.commits)")
    add_kafka_config_arg(p)
    p.add_argument("--index-poll", type=float, help="seconds between checks for a new index (5)")
    p.add_argument(
        "--generator-url",
        metavar="URL",
        help="OpenAI-compatible API for answers, e.g. http://vllm:8000/v1 "
        "(default $STREAMRAG_GENERATOR_URL, else the embedded SmolLM2 server)",
    )
    p.add_argument(
        "--generator-model",
        help="model name to ask for (default $STREAMRAG_GENERATOR_MODEL, else the first one /v1/models lists)",
    )
    p.add_argument("--max-tokens", type=int, help="longest answer in tokens (256)")
    p.add_argument("--generator-threads", type=int, help="CPU threads of the embedded generator (half the cores)")
    p.add_argument(
        "--no-answers", action="store_true", default=None, help="serve search and lineage only (no generator)"
    )
    p.add_argument(
        "--answer-style",
        choices=["generate", "extract"],
        help="answers of requests that name no style: extract (the sources' best sentences, each cited with its "
        "span; no model) or generate (a model writes them). Default: generate with --generator-url, extract with "
        "the embedded SmolLM2, whose answers measured less useful (README)",
    )
    p.add_argument(
        "--no-generator",
        action="store_true",
        default=None,
        help="start no model: /v1/answer gives extractive answers only",
    )
    p.add_argument(
        "--no-audit",
        action="store_true",
        default=None,
        help="do not record answers in the lake's audit table (benchmarks only)",
    )
    p.add_argument(
        "--audit-dead-letters",
        type=Path,
        metavar="FILE",
        help="where answer records the audit table refuses for good are set aside, as JSON lines "
        "(default ~/.local/state/streamrag/audit-dead-letters.jsonl)",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("lineage", help="audit queries: where an answer came from, what a source row fed")
    lsub = p.add_subparsers(dest="lineage_command", required=True)
    for name, about, params in (
        ("answer", "answer → citations → chunk versions → source rows, versions, models", ["answer_id"]),
        ("source", "source row → chunk versions → answers that used it", ["table", "pk"]),
        ("chunk", "a chunk's versions and the answers that used it", ["chunk_id"]),
    ):
        q = lsub.add_parser(name, help=about)
        for param in params:
            q.add_argument(param)
        q.add_argument("--lake", required=True, metavar="URI")
        q.add_argument(
            "--groups",
            help="see only what a caller in these comma-separated groups may see (default: everything, as an auditor)",
        )
        q.add_argument("--principal", default="cli", help="with --groups: the caller's name (their own answers)")
        q.add_argument("--json", action="store_true")
        q.set_defaults(func=cmd_lineage)

    p = sub.add_parser(
        "search", help="search from the command line (same engine as the API)", description=_env_help("search")
    )
    p.add_argument("query")
    _engine_args(p)
    p.add_argument("-k", type=int, help="(10)")
    p.add_argument("--groups", help="comma-separated groups of the caller (default: public only)")
    p.add_argument("--as-of", type=int, help="answer as of this lake version")
    p.add_argument(
        "--filter",
        metavar="JSON",
        help='only documents whose metadata matches, e.g. \'{"team": "eng", "year": [2025, 2026]}\'',
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_search)


def _engine(config: EngineSettings) -> Any:
    from indexing.store import open_store
    from pipelines.lake import Lake
    from retrieval.cache import ShardCache, default_cache_dir
    from retrieval.engine import SearchEngine
    from retrieval.views import EngineOptions, fusion_options
    from serving.embedder import load_embedder

    settings = ObjectStoreSettings.from_env()
    following = bool(getattr(config, "bootstrap", None))  # serve follows commit notices: poll as a fallback
    memory = config.cache_memory_mb << 20
    cache = ShardCache(config.cache_dir or default_cache_dir(), memory, config.cache_disk_mb << 20)
    options = EngineOptions(
        nprobe=config.nprobe,
        rerank=config.rerank,
        tail_poll_s=config.tail_poll or (2.0 if following else 0.5),
        index_poll_s=config.index_poll,
        prefetch_bytes=memory,
        mode=config.mode,
        rrf_k=config.rrf_k,
        fusion_depth=config.fusion_depth,
        keyword_depth=config.keyword_depth,
        feedback_docs=config.feedback_docs,
        feedback_weight=config.feedback_weight,
        keyword_dir=str(keyword_dir(config.cache_dir or default_cache_dir())),
        keyword_memory_bytes=config.keyword_memory_mb << 20,
        **fusion_options(
            config.fusion,
            keyword_weight=config.keyword_weight,
            identifier_weight=config.identifier_weight,
            code_weight=config.code_weight,
        ),
    )
    embedder = load_embedder(config.model, device=config.device, dtype=config.dtype, cpu_threads=config.cpu_threads)
    return SearchEngine(Lake.at(config.lake, settings), open_store(config.index, settings), embedder, cache, options)


def keyword_dir(cache_dir: Path) -> Path:
    """Where keyword index files go: beside the shard cache (whose disk bound is for shards)."""
    return cache_dir.with_name(cache_dir.name + "-keyword")


def cmd_search(args: argparse.Namespace) -> int:
    from retrieval.acl import Principal
    from retrieval.filters import MetadataFilter

    config = from_args(SearchSettings, args)
    try:
        where = MetadataFilter.parse(json.loads(config.filter)) if config.filter else None
    except ValueError as exc:  # FilterError and JSONDecodeError
        raise ValueError(f"--filter: {exc}") from exc
    engine = _engine(config)
    engine.start(background=False)
    groups = frozenset(g.strip() for g in config.groups.split(",") if g.strip())
    result = engine.search(config.query, config.k, Principal("cli", groups), config.as_of, where=where)
    if args.json:
        print(json.dumps({"mode": result.mode, "results": result.results, "index_version": result.index_version,
                          "lake_version": result.lake_version}))  # fmt: skip
        return 0
    print(f"index version {result.index_version}, lake version {result.lake_version}, {result.mode}:")
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


def _answers(config: ServeSettings, engine: Any, stack: Any) -> Any:
    """The answerer (generator client + audit log), or None with --no-answers."""
    from retrieval.answer import Answerer, AnswerOptions
    from retrieval.audit import AuditLog
    from serving.generator import Generator, GeneratorSettings
    from serving.local_generator import EmbeddedGenerator

    if config.no_answers:
        return None
    audit = None
    if config.no_audit:
        log.warning("the audit log is off (--no-audit): answers will not be traceable")
    else:
        audit = AuditLog(engine.lake, dead_letter_path=config.audit_dead_letters)
        audit.start()
        stack.callback(audit.stop)  # drains: no audit record lost on a graceful stop
    if config.no_generator:
        log.info("no generator (--no-generator): answers are extractive")
        return Answerer(engine, None, audit, options=AnswerOptions(style="extract"))
    identity = None
    url = config.generator_url
    if url is None:
        embedded = EmbeddedGenerator(threads=config.generator_threads)
        log.info("starting the embedded generator (%s); use --generator-url for vLLM", embedded.model.name)
        url = embedded.start()
        stack.callback(embedded.stop)
        identity = embedded.identity
    settings = GeneratorSettings(
        url, model=config.generator_model, api_key=config.generator_api_key,
        max_tokens=config.max_tokens,
    )  # fmt: skip
    generator = Generator(settings)
    stack.callback(generator.close)
    # On the FAQ benchmark (benchmarks/answer.py --only usefulness), extracts from the embedded
    # SmolLM2 setup cited the gold answer as often as its generated answers, with every citation
    # right (0.30 for SmolLM2's) and 20x faster: the embedded default. A real model (vLLM): generate.
    style = config.answer_style or ("generate" if config.generator_url else "extract")
    return Answerer(engine, generator, audit, identity, AnswerOptions(style=style))


def cmd_serve(args: argparse.Namespace) -> int:
    import contextlib

    import uvicorn

    from pipelines.lake import CHUNKS
    from pipelines.notices import NoticeFollower
    from pipelines.secrets import kafka_config
    from retrieval.api import create_app
    from retrieval.auth import Tokens
    from retrieval.lineage import Lineage

    config = from_args(ServeSettings, args, cli_only=("kafka_config",), kafka_config=kafka_config(args.kafka_config))
    problem = bind_error(config.host, config.port)
    if problem is not None:
        raise ValueError(f"cannot listen on {config.host}:{config.port} ({problem.strerror}); pick another --port.")
    tokens = Tokens.load(config.tokens) if config.tokens else None
    if tokens is None and config.host not in LOOPBACK:
        raise ValueError(f"refusing to listen on {config.host} without --tokens: anyone could search. "
                         "Give --tokens FILE, or serve on 127.0.0.1.")  # fmt: skip
    if tokens is None:
        log.warning("authentication is off (no --tokens): every caller is 'anonymous' and sees public documents only")
    else:
        log.info("authentication on: %d tokens", len(tokens))
    engine = _engine(config)
    with contextlib.ExitStack() as stack:
        answerer = _answers(config, engine, stack)
        stop = threading.Event()
        loader = threading.Thread(target=_load_in_background, args=(engine, stop), name="engine-loader", daemon=True)
        audit = answerer.audit if answerer is not None else None
        startup, shutdown = [loader.start], [stop.set, engine.stop]
        if config.bootstrap:
            notices = NoticeFollower(
                config.bootstrap, config.notices_topic, config.lake, CHUNKS, engine.notify, config.kafka_config
            )
            startup.append(notices.start)
            shutdown.insert(0, notices.stop)
        app = create_app(
            engine, tokens, answerer, Lineage(engine.lake, audit), config.rate_limit or None,
            search_on_loop=not config.search_on_workers, on_startup=startup, on_shutdown=shutdown,
        )  # fmt: skip
        # log_config=None: uvicorn's records go through our (redacting) handlers.
        server = uvicorn.Server(
            uvicorn.Config(
                app, host=config.host, port=config.port, log_level="warning", access_log=False, log_config=None
            )
        )

        def on_signal(_signum: int, _frame: object) -> None:
            server.should_exit = True

        # uvicorn re-raises the signal that stopped it once it is done; with these handlers
        # that ends here, and the audit log drains below instead of the process dying.
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        t0 = time.monotonic()
        try:
            server.run()
        finally:
            stop.set()
            engine.stop()
    log.info("stopped after %.0f s", time.monotonic() - t0)
    return 0 if server.started else 1


def cmd_lineage(args: argparse.Namespace) -> int:
    from pipelines.lake import Lake
    from retrieval.acl import Principal
    from retrieval.lineage import AUDITOR, Lineage

    lineage = Lineage(Lake.at(args.lake, ObjectStoreSettings.from_env()))
    if args.groups is None:
        who = Principal(args.principal, frozenset({AUDITOR}))
    else:
        who = Principal(args.principal, frozenset(g.strip() for g in args.groups.split(",") if g.strip()))
    if args.lineage_command == "answer":
        found = lineage.answer(args.answer_id, who)
    elif args.lineage_command == "source":
        found = lineage.source(args.table, args.pk, who)
    else:
        found = lineage.chunk(args.chunk_id, who)
    if args.json:
        print(json.dumps(found, default=str))
    else:
        print(render_lineage(args.lineage_command, found))
    return 0


def _where(v: dict[str, Any]) -> str:
    src, kafka = v["source"], v["source"]["kafka"]
    return (
        f"{src['table']} pk={src['pk']} position={src['position']} event_time={src['event_time']}\n"
        f"        kafka {kafka['topic']}[{kafka['partition']}]@{kafka['offset']}  ingested {v['ingest_time']}  "
        f"embedding {v['embedding_model']}"
    )


def render_lineage(kind: str, found: dict[str, Any]) -> str:
    """The lineage chain as a person reads it."""
    lines = []
    if kind == "answer":
        models = found["models"]
        lines += [
            f"answer {found['answer_id']}  ({found['status']}, {found['time']}, asked by {found['principal']})",
            f"  question: {found['question']}",
            f"  answer:   {found['answer']}",
            f"  lake version {found['lake_version']}, index version {found['index_version']}",
            f"  models: embedder {models['embedder']}; generator {models['generator']} at {models['generator_url']}",
            f"  prompt sha256 {found['prompt_hash']}",
            "  sources (the chunk versions in the prompt; * = cited):",
        ]
        cited = {c["n"] for c in found["citations"]}
        for s in found["sources"]:
            mark = "*" if s["n"] in cited else " "
            if not s.get("visible"):
                lines.append(f"   {mark}[{s['n']}] (not visible to you)")
                continue
            lines.append(f"   {mark}[{s['n']}] chunk {s['chunk_id']} of {s['doc_id']} ({s['origin']}, lake version "
                         f"{s['lake_version']}, now {s['now']})")  # fmt: skip
            lines.append(f"        {_where(s)}")
        for i, sentence in enumerate(found["sentences"]):
            support = ",".join(str(n) for n in sentence["sources"]) or "none: flagged"
            lines.append(f"  sentence {i + 1} [{support}]: {sentence['text']}")
    else:
        title = f"source {found['table']}/{found['pk']}" if kind == "source" else f"chunk {found['chunk_id']}"
        lines.append(f"{title}: {found['status']}")
        versions = found["chunk_versions"] if kind == "source" else found["versions"]
        lines.append(f"  {len(versions)} chunk versions:")
        for v in versions:
            lines.append(f"    {v['op']:<6} chunk {v['chunk_id']} #{v['chunk_index']}  {_where(v)}")
        lines.append(f"  {len(found['answers'])} answers used it:")
        for a in found["answers"]:
            use = "cited" if a["cited"] else "in prompt"
            lines.append(f"    {a['answer_id']}  {a['time']}  {a['principal']}  {use}  {a['question'][:80]}")
    return "\n".join(lines)
