from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from pipelines import secrets
from pipelines.secrets import KafkaConfigError, RedactingFormatter, kafka_config, redact, register_environment
from pipelines.settings import IngestSettings
from pipelines.storage import ObjectStoreSettings
from serving.generator import GeneratorSettings, display_url


def test_url_passwords_and_registered_values_are_masked() -> None:
    assert redact("GET http://svc:pa55word@vllm:8000/v1 failed") == "GET http://svc:***@vllm:8000/v1 failed"
    assert redact("s3://bucket/key and http://host/path stay") == "s3://bucket/key and http://host/path stay"
    register_environment({"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI-example", "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE1",
                          "STREAMRAG_KAFKA_SASL_PASSWORD": "kafka-pass-123", "AWS_SESSION_TOKEN": "short",
                          "STREAMRAG_KAFKA_SASL_USERNAME": "svc-user"})  # fmt: skip
    assert redact("key wJalrXUtnFEMI-example, kafka-pass-123") == "key ***, ***"
    assert redact("AKIAEXAMPLE1 svc-user short") == "AKIAEXAMPLE1 svc-user short"  # not secrets / too short
    # libpq connection strings (the Postgres source's --dsn)
    assert redact("dsn host=db password=pg-pass-1 user=cdc") == "dsn host=db password=*** user=cdc"
    assert redact("password = 'two words\\' x' dbname=app") == "password = *** dbname=app"
    register_environment({"PGPASSWORD": "libpq-pass-42"})
    assert redact("connect failed for libpq-pass-42") == "connect failed for ***"


def test_the_formatter_masks_messages_arguments_and_tracebacks() -> None:
    secrets.register("tok-abcdefghijklmnop")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(RedactingFormatter("%(message)s"))
    logger = logging.getLogger("test-secrets")
    logger.addHandler(handler)
    try:
        logger.warning("token %s refused", "tok-abcdefghijklmnop")
        try:
            raise ValueError("bad token tok-abcdefghijklmnop")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "tok-abcdefghijklmnop" not in out and out.count("***") == 3, out


def test_settings_keep_secrets_out_of_their_repr() -> None:
    store = ObjectStoreSettings("http://s3", "AKIA", "the-secret-key", "the-session-token", "eu-west-1")
    ingest = IngestSettings(topics=["t"], lake="/l", s3_secret_access_key="the-secret-key",
                            kafka_config={"sasl.password": "the-kafka-pass"})  # fmt: skip
    gen = GeneratorSettings("http://vllm/v1", api_key="sk-the-api-key")
    for text in (repr(store), repr(ingest), str(ingest), repr(gen)):
        assert "the-" not in text and "sk-" not in text, text
    assert display_url("http://u:p4ss@vllm:8000/v1") == "http://u:***@vllm:8000/v1"
    assert display_url("http://vllm:8000/v1") == "http://vllm:8000/v1"
    assert display_url("http://u:p4ss@[::1]:8000/v1") == "http://u:***@[::1]:8000/v1"  # brackets kept


def test_kafka_config_from_a_properties_file_and_variables(tmp_path: Path) -> None:
    path = tmp_path / "client.properties"
    path.write_text(
        "# a Confluent Cloud style client config\n"
        "security.protocol=SASL_SSL\nsasl.mechanisms = PLAIN\n! comment\n"
        "sasl.username=svc\nsasl.password=file-pass-123456\n\n"
    )
    env = {"STREAMRAG_KAFKA_SASL_PASSWORD": "env-pass-123456", "STREAMRAG_KAFKA_CLIENT_ID": "streamrag", "OTHER": "x"}
    config = kafka_config(path, env)
    assert config == {"security.protocol": "SASL_SSL", "sasl.mechanisms": "PLAIN", "sasl.username": "svc",
                      "sasl.password": "env-pass-123456", "client.id": "streamrag"}  # fmt: skip
    assert redact("file-pass-123456 env-pass-123456 svc") == "*** *** svc"
    assert kafka_config(None, {}) == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sasl.password: hunter2-hunter2\n", "expected key=value, got 'sasl.password …'"),
        ("=x\n", "expected key=value"),
        ("bootstrap.servers=a:9092\n", "set the brokers with --bootstrap"),
    ],
)
def test_bad_kafka_config_files_are_refused_without_showing_secrets(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "client.properties"
    path.write_text(text)
    with pytest.raises(KafkaConfigError) as err:
        kafka_config(path, {})
    assert message in str(err.value) and "hunter2" not in str(err.value)
    with pytest.raises(KafkaConfigError, match="cannot read"):
        kafka_config(tmp_path / "missing", {})
