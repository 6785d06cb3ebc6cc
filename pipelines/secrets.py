"""Secrets stay out of logs and error messages, and Kafka client settings for real clusters.

Every command's log output goes through :class:`RedactingFormatter`, which masks

- the values of known secret variables (``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
  ``STREAMRAG_GENERATOR_API_KEY``, any ``STREAMRAG_KAFKA_*`` whose name says password,
  secret, token or key, ``PGPASSWORD``), bearer tokens from the tokens file and secrets in
  a Kafka config file, once :func:`register` has seen them;
- the password in any ``scheme://user:password@host`` URL and in a libpq connection string
  (``password=…``).

This is the net under the rule, not the rule: code never formats a secret on purpose
(settings holding one keep it out of their repr). Values shorter than 8 characters are not
masked (they would garble ordinary words); real secrets are longer.

Kafka: ``--kafka-config FILE`` (Java-style ``key=value`` client properties, as for
``kafka-console-consumer --consumer.config``) and ``STREAMRAG_KAFKA_<PROPERTY>`` variables
(``STREAMRAG_KAFKA_SASL_PASSWORD`` → ``sasl.password``) are passed to librdkafka.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path

MASK = "***"
MIN_LENGTH = 8
SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "STREAMRAG_GENERATOR_API_KEY", "PGPASSWORD")
KAFKA_PREFIX = "STREAMRAG_KAFKA_"
_SECRET_WORDS = ("PASSWORD", "SECRET", "TOKEN", "KEY", "CREDENTIAL", "JAAS")
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]*):[^/\s@]+@")
#: a libpq key/value connection string's password (``password=x`` or ``password='x y'``)
_DSN_PASSWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?:'(?:[^'\\]|\\.)*'|[^\s']+)")

_lock = threading.Lock()
_secrets: set[str] = set()


class KafkaConfigError(ValueError):
    """A Kafka client config file or variable is unusable."""


def register(*values: str | None) -> None:
    """Mask these values in every log line from now on."""
    with _lock:
        _secrets.update(v for v in values if v and len(v) >= MIN_LENGTH)


def register_environment(env: Mapping[str, str] | None = None) -> None:
    env = os.environ if env is None else env
    register(*(env.get(name) for name in SECRET_VARIABLES))
    register(*(value for name, value in env.items() if name.startswith(KAFKA_PREFIX) and _looks_secret(name)))


def redact(text: str) -> str:
    text = _URL_PASSWORD.sub(rf"\g<head>:{MASK}@", text)
    text = _DSN_PASSWORD.sub(rf"\g<head>{MASK}", text)
    with _lock:
        secrets = sorted(_secrets, key=len, reverse=True)
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


class RedactingFormatter(logging.Formatter):
    """Formats as usual, then masks secrets in the whole record, traceback included."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def install(fmt: str) -> None:
    """Put the redacting formatter on every handler of the root logger."""
    register_environment()
    for handler in logging.getLogger().handlers:
        handler.setFormatter(RedactingFormatter(fmt))


def kafka_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """librdkafka properties from a client config file, overridden by STREAMRAG_KAFKA_* variables."""
    config: dict[str, str] = {}
    if path is not None:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise KafkaConfigError(f"cannot read the Kafka config file {path}: {exc.strerror or exc}") from exc
        for number, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith(("#", "!")):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise KafkaConfigError(f"{path}:{number}: expected key=value, got {_shown(line)!r}.")
            config[key.strip()] = value.strip()
            if _looks_secret(key):
                register(value.strip())  # even when a variable overrides it
    env = os.environ if env is None else env
    for name, value in env.items():
        if name.startswith(KAFKA_PREFIX) and len(name) > len(KAFKA_PREFIX):
            config[name[len(KAFKA_PREFIX) :].lower().replace("_", ".")] = value
    if "bootstrap.servers" in config:
        raise KafkaConfigError("set the brokers with --bootstrap, not in the Kafka config.")
    register_config(config)
    return config


def register_config(config: Mapping[str, str]) -> None:
    """Mask the secret-looking values of a Kafka client config (``sasl.password``, ``ssl.key.password``, …)."""
    register(*(value for key, value in config.items() if _looks_secret(key)))


def _looks_secret(name: str) -> bool:
    upper = name.upper().replace(".", "_")
    return any(word in upper for word in _SECRET_WORDS) and not upper.endswith(("_LOCATION", "_ID", "_MECHANISMS"))


def _shown(line: str) -> str:
    """A bad line for an error message: its first word only when it may hold a secret."""
    return re.split(r"[\s:=]", line, maxsplit=1)[0][:40] + " …" if _looks_secret(line) else line[:60]
