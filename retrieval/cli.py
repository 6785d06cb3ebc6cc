"""The ``streamrag`` command line (the contract in ARCHITECTURE.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from indexing.commands import add_commands as add_index_commands
from indexing.commands import add_lake_commands
from pipelines import secrets
from pipelines.commands import add_commands as add_pipeline_commands
from pipelines.settings import SettingsError
from retrieval.commands import add_commands as add_retrieval_commands
from retrieval.demo import add_command as add_demo_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrag", description="Streaming RAG pipeline with lineage.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    add_pipeline_commands(sub)
    add_index_commands(sub)
    add_lake_commands(sub)
    add_retrieval_commands(sub)
    add_demo_command(sub)
    return parser


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    secrets.install(LOG_FORMAT)  # no secret value reaches a log line, -v included
    if not args.verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per generator call otherwise
    try:
        status = args.func(args)
    except KeyboardInterrupt:
        status = 130
    except SettingsError as exc:  # a usage error, as argparse's own
        print(secrets.redact(f"error: {exc}"), file=sys.stderr)
        status = 2
    except Exception as exc:
        logging.getLogger("streamrag").debug("failed", exc_info=True)
        print(secrets.redact(f"error: {exc}"), file=sys.stderr)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # deltalake's runtime threads can abort interpreter teardown (exit 134) after the
    # work is done; leave with the real status instead.
    os._exit(int(status or 0))


if __name__ == "__main__":
    main()
