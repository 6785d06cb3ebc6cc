"""One way to configure every command: flags, else STREAMRAG_<COMMAND>_<OPTION>, else defaults."""

from __future__ import annotations

import pytest

from indexing.settings import IndexBuildSettings
from pipelines.settings import IngestSettings, SettingsError, from_args
from retrieval.cli import build_parser
from retrieval.settings import SearchSettings, ServeSettings


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(list(argv))


def test_variables_configure_every_command_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "STREAMRAG_SERVE_LAKE": "s3://lake/x", "STREAMRAG_SERVE_INDEX": "s3://index/x", "STREAMRAG_SERVE_NPROBE": "64",
        "STREAMRAG_SERVE_PORT": "9001", "STREAMRAG_GENERATOR_URL": "http://vllm:8000/v1",
        "STREAMRAG_GENERATOR_API_KEY": "sk-secret", "STREAMRAG_SEARCH_K": "3", "STREAMRAG_SEARCH_LAKE": "./l",
        "STREAMRAG_SEARCH_INDEX": "./i", "STREAMRAG_INDEX_BUILD_KEEP": "5", "STREAMRAG_INDEX_BUILD_GC_GRACE": "60",
        "STREAMRAG_INGEST_WORKERS": "3",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    serve = from_args(ServeSettings, parse("serve", "--port", "9002"))
    assert (serve.lake, serve.nprobe, serve.port, serve.generator_url) == (
        "s3://lake/x",
        64,
        9002,
        "http://vllm:8000/v1",
    )
    assert serve.generator_api_key == "sk-secret" and "sk-secret" not in repr(serve)
    assert not serve.search_on_workers
    assert from_args(ServeSettings, parse("serve", "--search-on-workers")).search_on_workers
    monkeypatch.setenv("STREAMRAG_SERVE_GENERATOR_URL", "http://other:8000/v1")  # the command's own name wins
    assert from_args(ServeSettings, parse("serve")).generator_url == "http://other:8000/v1"
    search = from_args(SearchSettings, parse("search", "penguins", "-k", "7"))
    assert (search.query, search.k, search.lake) == ("penguins", 7, "./l")
    assert from_args(SearchSettings, parse("search", "penguins")).k == 3
    build = from_args(IndexBuildSettings, parse("index", "build", "--lake", "a", "--index", "b"))
    assert (build.keep, build.gc_grace, build.reuse_centroids) == (5, 60.0, False)
    assert from_args(IndexBuildSettings, parse("index", "build", "--lake", "a", "--index", "b", "--reuse-centroids"))
    ingest = from_args(IngestSettings, parse("ingest", "--topic", "t", "--bootstrap", "b:1", "--lake", "l"),
                       cli_only=("openlineage", "process_id",
                       "addresses", "kafka_config"))  # fmt: skip
    assert ingest.workers == 3


def test_a_wrong_or_missing_option_names_its_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError, match="--lake: Field required"):
        from_args(ServeSettings, parse("serve", "--index", "i"))
    with pytest.raises(SettingsError, match="--nprobe: Input should be greater than or equal to 1"):
        from_args(SearchSettings, parse("search", "q", "--lake", "l", "--index", "i", "--nprobe", "0"))
    with pytest.raises(SettingsError, match="--feedback-docs: Input should be greater than or equal to 0"):
        from_args(SearchSettings, parse("search", "q", "--lake", "l", "--index", "i", "--feedback-docs", "-1"))
    off = from_args(SearchSettings, parse("search", "q", "--lake", "l", "--index", "i", "--feedback-docs", "0"))
    assert (off.feedback_docs, off.feedback_weight) == (0, 1.0)
    with pytest.raises(SettingsError, match="--gc-grace"):
        from_args(IndexBuildSettings, parse("index", "build", "--lake", "l", "--index", "i", "--gc-grace", "-1"))
    monkeypatch.setenv("STREAMRAG_SERVE_MAX_TOKENS", "0")
    with pytest.raises(SettingsError, match="--max-tokens"):
        from_args(ServeSettings, parse("serve", "--lake", "l", "--index", "i"))
