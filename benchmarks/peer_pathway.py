"""Pathway 0.33's live vector index over the same Debezium topic: the freshness peer.

Runs in the peer virtualenv that ``make bench`` creates (Pathway pins pyarrow < 26, so it
cannot share the project's environment); ``benchmarks/retrieval.py --only freshness``
starts it beside ``streamrag ingest`` and ``streamrag serve`` and times both the same way.

The documents table is Pathway's own Debezium connector (upserts and deletes by primary
key), each document's body is one chunk (the benchmark's documents are one chunk for
streamrag too), embedded with the same all-MiniLM-L6-v2 files by Pathway's
``SentenceTransformerEmbedder``, and served by ``VectorStoreServer`` (``/v1/retrieve``).
Connectors commit every ``--commit-ms`` (Pathway's default is 1500 ms; 100 ms here, as
the earlier peer measurement used).
"""

from __future__ import annotations

import argparse
import json

import pathway as pw
from pathway.xpacks.llm.embedders import SentenceTransformerEmbedder
from pathway.xpacks.llm.vector_store import VectorStoreServer


class Doc(pw.Schema):
    id: int = pw.column_definition(primary_key=True)
    title: str
    body: str


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True, help="the sentence-transformers model directory")
    parser.add_argument("--commit-ms", type=int, default=100)
    parser.add_argument("--cpu-threads", type=int, help="torch threads (as streamrag's --cpu-threads)")
    parser.add_argument("--kafka-config", default="{}", help="extra librdkafka settings (JSON)")
    args = parser.parse_args()
    if args.cpu_threads:
        import torch

        torch.set_num_threads(args.cpu_threads)
    settings = {
        "bootstrap.servers": args.bootstrap,
        "group.id": "pathway-peer",
        "auto.offset.reset": "earliest",
        **json.loads(args.kafka_config),
    }
    docs = pw.io.debezium.read(settings, args.topic, schema=Doc, autocommit_duration_ms=args.commit_ms)
    table = docs.select(
        data=pw.apply(lambda body: body.encode(), pw.this.body),
        _metadata=pw.apply(lambda title: pw.Json({"title": title}), pw.this.title),  # ("id" is Pathway's row id)
    )
    embedder = SentenceTransformerEmbedder(model=args.model, device="cpu")
    server = VectorStoreServer(table, embedder=embedder)
    server.run_server("127.0.0.1", args.port, with_cache=False)


if __name__ == "__main__":
    main()
