"""Tokens files: what loads, what is refused with a reason, how tokens are matched."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrieval.acl import Principal
from retrieval.auth import AuthError, Tokens, bearer


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_and_json_tokens(tmp_path: Path) -> None:
    yml = write(tmp_path, "t.yaml", "tokens:\n  aaaaaaaaaaaaaaaa1:\n    principal: hana\n    groups: [hr, staff]\n")
    assert Tokens.load(yml).principal("aaaaaaaaaaaaaaaa1") == Principal("hana", frozenset({"hr", "staff"}))
    js = write(tmp_path, "t.json", '{"bbbbbbbbbbbbbbbb2": {"principal": "bob", "groups": "eng, ops"}}')
    tokens = Tokens.load(js)
    assert tokens.principal("bbbbbbbbbbbbbbbb2") == Principal("bob", frozenset({"eng", "ops"}))
    assert tokens.principal("bbbbbbbbbbbbbbbb") is None and tokens.principal("") is None
    assert tokens.principal("bbbbbbbbbbbbbbbb2\u00e9") is None


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{}", "no tokens"),
        ("[1, 2]", "must map tokens"),
        ("short: {principal: a}", "at least 16"),
        ("aaaaaaaaaaaaaaaaaa: {groups: [x]}", "principal"),
        ("aaaaaaaaaaaaaaaaaa: {principal: a, groups: {x: 1}}", "groups"),
        ("aaaaaaaaaaaaaaaaaa: [", "not valid YAML"),
    ],
)
def test_bad_tokens_files_say_what_is_wrong(tmp_path: Path, text: str, problem: str) -> None:
    with pytest.raises(AuthError, match=problem):
        Tokens.load(write(tmp_path, "t.yaml", text))
    with pytest.raises(AuthError, match="cannot read"):
        Tokens.load(tmp_path / "missing.yaml")


def test_bearer_header() -> None:
    assert bearer("Bearer abc") == "abc" and bearer("bearer  abc ") == "abc"
    assert bearer(None) is None and bearer("Basic abc") is None and bearer("Bearer ") is None
