"""CLI: ``streamrag index build`` and ``streamrag lake maintain``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import tempfile
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from indexing.manifest import DEFAULT_GC_GRACE_S, latest_version
from indexing.settings import IndexBuildSettings
from pipelines.commands import add_openlineage_arg
from pipelines.settings import from_args
from pipelines.storage import ObjectStoreSettings

if TYPE_CHECKING:
    from indexing.snapshot import Snapshot
    from pipelines.lake import Lake

log = logging.getLogger(__name__)

#: how often ``--tail-rows`` counts the rows committed since the last build (one GET per new commit)
TAIL_CHECK_S = 5.0


def add_commands(sub: Any) -> None:
    index = sub.add_parser("index", help="build IVF vector indexes from the lake")
    isub = index.add_subparsers(dest="index_command", required=True)
    p = isub.add_parser(
        "build",
        help="snapshot the lake, train k-means (in-process or on Ray), publish IVF shards",
        description="Every option can also be set as a variable STREAMRAG_INDEX_BUILD_<OPTION> "
        "(STREAMRAG_INDEX_BUILD_KEEP=5); flags win.",
    )
    p.add_argument("--lake", metavar="URI", help="the lake (required)")
    p.add_argument("--index", metavar="URI", help="index store: path, file:// or s3:// (required)")
    p.add_argument("--nlist", type=int, help="IVF lists (default about 4*sqrt(N))")
    p.add_argument("--lake-version", type=int, help="Delta version to index (default latest)")
    p.add_argument("--ray-address", help="join a Ray cluster (implies --executor ray)")
    p.add_argument(
        "--executor",
        choices=["auto", "local", "ray"],
        help="auto (default): in this process while the vectors take at most a quarter of this machine's "
        "(or container's) memory (no Ray start-up), else Ray "
        "(local Ray on this machine's cores unless --ray-address)",
    )
    p.add_argument("--iterations", type=int, help="k-means iterations at most (20)")
    p.add_argument("--seed", type=int, help="(1234)")
    p.add_argument("--shard-mb", type=float, help="target shard size in MB (64)")
    p.add_argument(
        "--codec",
        help="flat (default): float32 IVF shards, fetched whole; sq8/sq4: 8- or 4-bit scalar-quantized "
        "lists, pqM (e.g. pq48): product-quantized lists of M bytes per vector; compressed lists are "
        "fetched by byte range, cached list by list and re-ranked exactly with float vectors fetched by range",
    )
    p.add_argument(
        "--reuse-centroids",
        action="store_true",
        default=None,
        help="assign to the last build's centroids unless they drifted; then, while few chunks changed, build "
        "incrementally (see --max-delta)",
    )
    p.add_argument(
        "--assign-nprobe",
        type=int,
        metavar="N",
        help="the smallest nprobe the index is built for: assigning vectors to lists through a coarse level may "
        "cost at most 0.005 recall@10 there, estimated on a sample at build time (default: serve's default nprobe "
        "for the index's nlist); serving at a smaller --nprobe may lose more (stats.assign_recall_loss)",
    )
    p.add_argument("--drift-threshold", type=float, help="retrain above this quantization-error growth (0.10)")
    p.add_argument(
        "--max-delta",
        type=float,
        metavar="SHARE",
        help="with --reuse-centroids: an incremental build (only the chunks changed since the last full build are "
        "written; the rest is shared with it) while at most this share of the chunks changed, else a full one (0.10)",
    )
    p.add_argument(
        "--full",
        action="store_true",
        default=None,
        help="with --reuse-centroids: assign and rewrite everything even when an incremental build would do",
    )
    p.add_argument("--keep", type=int, help="keep only the newest N versions (after --gc-grace)")
    p.add_argument(
        "--gc-grace",
        type=float,
        metavar="SECONDS",
        help="with --keep: delete a version only this long after a newer one replaced it, so replicas still "
        f"serving it and as_of requests on it finish first ({DEFAULT_GC_GRACE_S:.0f})",
    )
    p.add_argument("--json", action="store_true", help="print the manifest summary as JSON")
    p.add_argument(
        "--store-patience",
        type=float,
        metavar="SECONDS",
        help="once a build has started, retry an unreachable index store this long before failing (300)",
    )
    p.add_argument(
        "--every",
        type=float,
        metavar="SECONDS",
        help="keep building: a new version every SECONDS when the lake changed (a failed build is logged and retried)",
    )
    p.add_argument(
        "--tail-rows",
        type=int,
        metavar="N",
        help="keep building: a new version as soon as N chunk versions were committed since the last build, "
        f"so replicas' fresh tails stay small (checked every {TAIL_CHECK_S:.0f} s; with or without --every)",
    )
    add_openlineage_arg(p)
    p.set_defaults(func=cmd_index_build)


def _short_temp_dir() -> str:
    """Ray puts Unix sockets under its temp dir, and socket paths are limited to 107 bytes."""
    base = tempfile.gettempdir()
    if len(base) > 40 and os.access("/tmp", os.W_OK):
        return "/tmp"
    return base


def cmd_index_build(args: argparse.Namespace) -> int:
    config = from_args(IndexBuildSettings, args)
    if config.every is None and config.tail_rows is None:
        return _build_once(config, args.json)
    return _keep_building(config, args.json)


def _keep_building(config: IndexBuildSettings, as_json: bool) -> int:
    """Build whenever the lake changed and ``every`` seconds passed, or ``tail_rows`` rows were committed."""
    from indexing.manifest import load_manifest
    from indexing.snapshot import rows_committed
    from indexing.store import open_store
    from pipelines.lake import CHUNKS, Lake

    settings = ObjectStoreSettings.from_env()
    check_s = min(config.every or TAIL_CHECK_S, TAIL_CHECK_S if config.tail_rows else float("inf"))
    built_from: int | None = None  # the lake version of the newest index
    built_at = 0.0  # monotonic time of the last build (0: build at once if the lake changed)
    counted = (-1, 0)  # (up to lake version, rows committed after built_from)
    while True:
        try:
            store = open_store(config.index, settings)
            newest = latest_version(store)
            if built_from is None and newest is not None:
                built_from = load_manifest(store, newest).lake_version
            lake = Lake.at(config.lake, settings)
            lake_version = lake.table(CHUNKS).version()
            due = built_from is None or (
                lake_version > built_from and (config.every is not None and time.monotonic() - built_at >= config.every)
            )
            if not due and config.tail_rows and built_from is not None and lake_version > built_from:
                start, rows = counted if counted[0] >= built_from else (built_from, 0)
                more = rows_committed(lake, start, lake_version)
                counted = (lake_version, rows + (config.tail_rows if more is None else more))
                due = counted[1] >= config.tail_rows
                if due:
                    log.info("%d chunk versions committed since the last build: building now", counted[1])
            if due:
                _build_once(config, as_json)
                newest = latest_version(store)
                built_from = lake_version if newest is None else load_manifest(store, newest).lake_version
                built_at, counted = time.monotonic(), (-1, 0)
            else:
                log.debug("no build due at lake version %d; next check in %.0f s", lake_version, check_s)
        except Exception as exc:  # noqa: BLE001 - keep going: the next round may succeed
            log.error("index build failed (retrying in %.0f s): %s", check_s, exc)
        time.sleep(check_s)


def _build_once(config: IndexBuildSettings, as_json: bool) -> int:
    from pipelines.openlineage import LineageRun, storage
    from pipelines.storage import join

    run = LineageRun("index_build", config.openlineage)
    inputs, outputs = [storage(join(config.lake, "chunks"))], [storage(config.index)]
    run.start(inputs, outputs)
    try:
        summary = _build(config)
    except BaseException as exc:
        run.fail(inputs, outputs, exc)
        raise
    inputs = [storage(join(config.lake, "chunks"), str(summary["lake_version"]))]
    run.complete(inputs, [storage(config.index, str(summary["version"]))])
    if as_json:
        print(json.dumps(summary))
    else:
        stats = summary["stats"]
        how = (
            f"incremental on version {stats['base_version']}: {stats['changed_chunks']} chunks changed since, "
            f"{stats['written_bytes'] / 2**20:.1f} MB written, {stats['reused_bytes'] / 2**20:.1f} MB shared"
            if stats.get("incremental")
            else f"full build, {stats['written_bytes'] / 2**20:.1f} MB written"
            + (f" ({stats['full_reason']})" if stats.get("full_reason") else "")
        )
        print(
            f"published index version {summary['version']}: {summary['count']} vectors, nlist {summary['nlist']}, "
            f"{summary['shards']} shards, lake version {summary['lake_version']}; {how}"
        )
    return 0


def _build(config: IndexBuildSettings) -> dict[str, Any]:
    from indexing.distributed import stop_ray
    from indexing.ivf import BuildOptions, build_index
    from indexing.manifest import collect_garbage, latest_version, publish
    from indexing.store import open_store
    from pipelines.lake import Lake

    settings = ObjectStoreSettings.from_env()
    lake = Lake.at(config.lake, settings)
    previous = latest_version(open_store(config.index, settings))  # fails fast, before any work, when unreachable
    # From here on an outage is most likely passing: every store operation rides it out.
    settings = dataclasses.replace(settings, patience_s=config.store_patience)
    store = open_store(config.index, settings)
    snap = _plan(lake, config.lake_version)
    log.info(
        "lake %s version %d: %d live chunks of %s; index store at version %s",
        lake.uri, snap.version, snap.count, snap.model, previous,
    )  # fmt: skip
    opts = BuildOptions(
        nlist=config.nlist,
        iterations=config.iterations,
        seed=config.seed,
        shard_bytes=int(config.shard_mb * (1 << 20)),
        reuse_centroids=config.reuse_centroids,
        drift_threshold=config.drift_threshold,
        incremental=not config.full,
        max_delta=config.max_delta,
        codec=config.codec,
        assign_nprobe=config.assign_nprobe,
        executor="ray" if config.ray_address else config.executor,
        ray_address=config.ray_address,
    )
    # Ray starts only if the build uses it (an incremental build's small delta does not)
    with tempfile.TemporaryDirectory(prefix="srray-", dir=_short_temp_dir()) as tmp:
        try:
            manifest = build_index(snap, store.root, settings, dataclasses.replace(opts, ray_dir=tmp))
        finally:
            stop_ray()
    version = publish(store, manifest)
    deleted = collect_garbage(store, config.keep, config.gc_grace) if config.keep else []
    summary = {
        "version": version, "lake_version": snap.version, "count": manifest.count, "nlist": manifest.nlist,
        "codec": manifest.codec,
        "shards": len(manifest.shards), "model": manifest.model, "deleted_versions": deleted,
        "stats": manifest.stats,
    }  # fmt: skip
    return summary


def _plan(lake: Lake, version: int | None) -> Snapshot:
    """The snapshot to build from. A read of the log and the files that fails for another
    reason than the lake's content (a ``LakeError`` says what is wrong with the lake) is tried
    twice more, each failure logged with its reason: a build started while the stream commits
    must not fail on a read that the next attempt gets right."""
    from indexing.snapshot import plan
    from pipelines.lake import LakeError
    from serving.retry import attempts, retrying

    for attempt in retrying(
        retry_on=lambda exc: isinstance(exc, Exception) and not isinstance(exc, LakeError),
        stop=attempts(3),
        log=log,
        what=f"reading the lake {lake.uri}",
    ):
        with attempt:
            return plan(lake, version)
    raise AssertionError("unreachable: retrying() re-raises the last failure")


def add_lake_commands(sub: Any) -> None:
    """``streamrag lake maintain``. It lives beside ``index``: what it may delete depends on
    the index versions that are kept (``indexing.maintain``)."""
    from indexing.maintain import DEFAULT_RETENTION_HOURS, DEFAULT_TARGET_MB, MIN_RETENTION_HOURS

    lake = sub.add_parser("lake", help="keep the lake healthy: compaction, checkpoints, vacuum")
    lsub = lake.add_subparsers(dest="lake_command", required=True)
    p = lsub.add_parser(
        "maintain",
        help="compact small files, checkpoint and vacuum, keeping every file a kept index version or as_of needs",
        description="Run it beside the streaming job with --every 60 (or from cron); "
        "the job does no maintenance itself.",
    )
    p.add_argument("--lake", required=True, metavar="URI")
    p.add_argument(
        "--index",
        action="append",
        default=[],
        metavar="URI",
        help="an index store built from this lake (repeat for several): vacuum keeps every file its oldest kept "
        "version and the commits after it name",
    )
    p.add_argument(
        "--no-index",
        action="store_true",
        help="no index is built from this lake: only --retention-hours protects files (else --index is required)",
    )
    p.add_argument(
        "--retention-hours",
        type=float,
        default=DEFAULT_RETENTION_HOURS,
        help=f"keep files removed less than this long ago: as_of promises, the audit period "
        f"({DEFAULT_RETENTION_HOURS:g}; at least {MIN_RETENTION_HOURS:g})",
    )
    p.add_argument("--dry-run", action="store_true", help="compact nothing; report what vacuum would delete")
    p.add_argument(
        "--target-file-mb",
        type=float,
        default=DEFAULT_TARGET_MB,
        help=f"compact small files into files of up to this size; larger ones are left alone ({DEFAULT_TARGET_MB:g})",
    )
    p.add_argument(
        "--every",
        type=float,
        metavar="SECONDS",
        help="keep maintaining: compaction and a checkpoint every SECONDS (60 is a good pace: each commit of the "
        "stream costs time in proportion to the files in the table), vacuum every --vacuum-every",
    )
    p.add_argument(
        "--vacuum-every",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="with --every: vacuum and clean up the log at most this often (3600)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line per round")
    p.set_defaults(func=cmd_lake_maintain)


def cmd_lake_maintain(args: argparse.Namespace) -> int:
    from indexing.maintain import MaintainError, check_retention, maintain_lake
    from pipelines.lake import Lake

    if not args.index and not args.no_index:
        print(
            "error: give --index URI for every index store built from this lake (vacuum must keep what their "
            "versions read), or --no-index if there is none.",
            file=sys.stderr,
        )
        return 2
    if args.index and args.no_index:
        print("error: --index and --no-index contradict each other.", file=sys.stderr)
        return 2
    try:
        check_retention(args.retention_hours)  # once: a loop would only repeat it
    except MaintainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lake = Lake.at(args.lake, ObjectStoreSettings.from_env())
    vacuumed_at = -math.inf
    while True:
        status = 0
        vacuum = args.every is None or time.monotonic() - vacuumed_at >= args.vacuum_every
        try:
            run = partial(maintain_lake, lake, args.index, args.retention_hours, args.dry_run,
                          target_mb=args.target_file_mb)  # fmt: skip
            try:
                protection, reports = run(vacuum=vacuum)
            except MaintainError as exc:
                if args.every is None:
                    raise
                # Vacuum cannot run safely (say, an index of another lake): keep compacting, say why.
                log.error("%s; compacting without vacuum until that is fixed", exc)
                protection, reports = run(vacuum=False)
                vacuum = False
            if vacuum:
                vacuumed_at = time.monotonic()
            status = 1 if any(r.errors for r in reports) else 0
            _print_maintenance(protection, reports, args.json, args.dry_run)
        except MaintainError:
            raise
        except Exception as exc:
            if args.every is None:
                raise
            log.error("lake maintenance failed (retrying in %.0f s): %s", args.every, exc)
        if args.every is None:
            return status
        time.sleep(args.every)


def _print_maintenance(protection: Any, reports: list[Any], as_json: bool, dry_run: bool) -> None:
    if as_json:
        print(json.dumps({"dry_run": dry_run, "protected": dataclasses.asdict(protection),
                          "tables": [dataclasses.asdict(r) for r in reports]}, default=str), flush=True)  # fmt: skip
        return
    if protection.lake_version is not None:
        print(f"keeping every chunks file removed after lake version {protection.lake_version} "
              f"({protection.since:%Y-%m-%d %H:%M:%S} UTC; oldest kept index versions: "
              f"{', '.join(f'{u} v{n}' for u, n in protection.index_versions.items())})")  # fmt: skip
    for r in reports:
        verb = "would vacuum" if dry_run else "vacuumed"
        vacuumed = "no vacuum this round" if r.vacuumed is None else f"{verb} {r.vacuumed}"
        print(f"{r.table}: {r.files_before} files ({r.bytes_before / 1e6:.1f} MB) -> {r.files_after} "
              f"({r.bytes_after / 1e6:.1f} MB); compacted {r.files_compacted} into {r.files_written}; "
              f"{vacuumed} (retention {r.retention_hours:g} h); checkpoint "
              f"{r.checkpoint_version if r.checkpoint_version is not None else '-'}; log cleanup {r.log_cleanup}; "
              f"{r.seconds:.1f} s")  # fmt: skip
        for error in r.errors:
            print(f"{r.table}: error: {error}", file=sys.stderr)
    sys.stdout.flush()
