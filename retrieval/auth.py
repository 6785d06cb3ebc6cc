"""Bearer tokens → principals, from a YAML or JSON file.

    tokens:                       # or the mapping at the top level
      s3cr3t-token-of-hana:
        principal: hana
        groups: [hr, staff]
      another-token: {principal: bob}

A token is compared with every configured token in constant time (``hmac.compare_digest``
over SHA-256 digests, so neither its content nor its length leaks through timing).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipelines import secrets
from retrieval.acl import Principal


class AuthError(Exception):
    """The tokens file is unusable; the message says what is wrong with it."""


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    principal: Principal


class Tokens:
    def __init__(self, mapping: dict[str, Principal]) -> None:
        if not mapping:
            raise AuthError("the tokens file defines no tokens.")
        self._entries = [_Entry(_digest(t), p) for t, p in mapping.items()]

    @classmethod
    def load(cls, path: Path) -> Tokens:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise AuthError(f"cannot read the tokens file {path}: {exc.strerror or exc}") from exc
        try:
            raw: Any = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise AuthError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}") from exc
        if isinstance(raw, dict) and isinstance(raw.get("tokens"), dict):
            raw = raw["tokens"]
        if not isinstance(raw, dict):
            raise AuthError(f"{path} must map tokens to {{principal, groups}}.")
        mapping: dict[str, Principal] = {}
        for token, entry in raw.items():
            where = f"{path}: token #{len(mapping) + 1}"
            if not isinstance(token, str) or len(token) < 16:
                raise AuthError(f"{where}: tokens must be strings of at least 16 characters.")
            if not isinstance(entry, dict) or not isinstance(entry.get("principal"), str) or not entry["principal"]:
                raise AuthError(f"{where}: needs a 'principal' name.")
            groups = entry.get("groups") or []
            if isinstance(groups, str):
                groups = [g.strip() for g in groups.split(",") if g.strip()]
            if not isinstance(groups, list) or not all(isinstance(g, str) and g for g in groups):
                raise AuthError(f"{where}: 'groups' must be a list of group names.")
            mapping[token] = Principal(entry["principal"], frozenset(groups))
        secrets.register(*mapping)  # masked in every log line from now on
        return cls(mapping)

    def principal(self, token: str) -> Principal | None:
        """The principal of a token, or None; takes the same time whichever token matches."""
        digest = _digest(token)
        found = None
        for entry in self._entries:
            if hmac.compare_digest(digest, entry.digest):
                found = entry.principal
        return found

    def __len__(self) -> int:
        return len(self._entries)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer …`` header, if well formed."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
