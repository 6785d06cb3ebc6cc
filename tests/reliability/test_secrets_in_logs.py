"""No secret in any log, response, audit row or lineage event, with debug logging on.

Every command runs as a user runs it, with `-v` (debug logs: botocore prints the headers it
sends) and with distinctive secrets: the S3 secret key and session token, a Kafka SASL
password from a client config file and another from a STREAMRAG_KAFKA_* variable, the
generator's API key and a password in its URL, the API's bearer tokens. The generator stub
fails some requests and echoes the credentials it got in its error text, as some servers
do. Then every byte the system wrote where people look is searched for every secret.
The positive controls (the stub saw the key; S3 holds the objects; botocore's debug lines
were masked) show the secrets were really in play.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from pipelines.lake import Lake
from retrieval.audit import ANSWERS
from tests.conftest import free_port
from tests.corpus import make_corpus
from tests.integration.helpers import cli, start
from tests.integration.test_serve import wait_ready

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

AWS_SECRET = "aws-secret-Zq8vN3kLp0"
AWS_SESSION = "aws-session-Hx2mW7rT5y"
KAFKA_FILE_PASSWORD = "kafka-file-pass-Ue4sJ9"
KAFKA_ENV_PASSWORD = "kafka-env-pass-Rb6dK1"
API_KEY = "sk-gen-key-Pv3nQ8wE2z"
URL_PASSWORD = "url-pass-Cj5tY0"
TOKEN = "tok-reader-Lm4xB7qS9dF2"
SECRETS = [AWS_SECRET, AWS_SESSION, KAFKA_FILE_PASSWORD, KAFKA_ENV_PASSWORD, API_KEY, URL_PASSWORD, TOKEN]


class Stub:
    """An OpenAI-compatible generator that records credentials and echoes them when it fails."""

    def __init__(self) -> None:
        self.auth: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: dict) -> None:  # type: ignore[type-arg]
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                stub.auth.append(self.headers.get("authorization", ""))
                self._send(200, {"data": [{"id": "stub-model"}]})

            def do_POST(self) -> None:
                given = self.headers.get("authorization", "")
                stub.auth.append(given)
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                question = body["messages"][-1]["content"]
                if "refuse me" in question:
                    self._send(401, {"error": f"invalid credentials {given} for {self.path}"})
                elif "break me" in question:
                    self._send(503, {"error": "overloaded"})
                else:
                    reply = {"message": {"content": "Streaming lakes keep chunk versions."}, "finish_reason": "stop"}
                    self._send(200, {"model": "stub-model", "choices": [reply]})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.server.shutdown()
    s.server.server_close()


def test_no_secret_in_logs_responses_audit_or_lineage(broker: str, s3_server, stub: Stub, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    lineage_events = tmp_path / "openlineage.jsonl"
    env = {**s3_server.env, "AWS_SECRET_ACCESS_KEY": AWS_SECRET, "AWS_SESSION_TOKEN": AWS_SESSION,
           "STREAMRAG_KAFKA_SASL_PASSWORD": KAFKA_ENV_PASSWORD, "STREAMRAG_GENERATOR_API_KEY": API_KEY,
           "STREAMRAG_OPENLINEAGE": f"file:{lineage_events}"}  # fmt: skip
    kafka_config = tmp_path / "client.properties"
    kafka_config.write_text(
        f"client.id=streamrag-secrets-test\nsasl.username=svc\nsasl.password={KAFKA_FILE_PASSWORD}\n"
    )
    lake = f"{s3_server.create_bucket('lake-secrets')}/lake"
    index = f"{s3_server.create_bucket('index-secrets')}/idx"
    topic = "cdc.app.public.docs_secrets"
    corpus = make_corpus(seed=5, docs=20, updates=3, deletes=2).write(tmp_path / "events.jsonl")
    outputs: dict[str, str] = {}

    def run(name: str, *args: str) -> None:
        out = cli("-v", *args, env=env, timeout=600)
        outputs[name] = out.stdout + out.stderr
        assert out.returncode == 0, outputs[name][-3000:]

    from pipelines.broker import ensure_topics

    ensure_topics(broker, [topic], partitions=2)
    run("produce", "produce", "--bootstrap", broker, "--topic", topic, "--kafka-config", str(kafka_config), str(corpus))
    run("ingest", "ingest", "--bootstrap", broker, "--topic", topic, "--lake", lake, "--until-idle", "4",
        "--workers", "2", "--kafka-config", str(kafka_config))  # fmt: skip
    run("index", "index", "build", "--lake", lake, "--index", index, "--nlist", "4")

    (tmp_path / "tokens.yaml").write_text(json.dumps({"tokens": {TOKEN: {"principal": "reader", "groups": []}}}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    generator_url = f"http://svc:{URL_PASSWORD}@127.0.0.1:{stub.port}/v1"
    serve = start(["-v", "serve", "--lake", lake, "--index", index, "--port", str(port), "--tokens",
                   str(tmp_path / "tokens.yaml"), "--generator-url", generator_url, "--cache-dir",
                   str(tmp_path / "cache")], env, tmp_path / "serve.log")  # fmt: skip
    responses: list[str] = []
    try:
        wait_ready(url, serve)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=url, timeout=60) as http:
            for question, status in [("what do streaming lakes keep?", 200), ("refuse me: lakes?", 502),
                                     ("break me: lakes?", 502)]:  # fmt: skip
                r = http.post("/v1/answer", json={"question": question}, headers=auth)
                responses.append(r.text)
                assert r.status_code == status, r.text
            r = http.post("/v1/answer", json={"question": "refuse me: lakes?", "stream": True}, headers=auth)
            responses.append(r.text)
            for attempt in (f"Bearer {TOKEN[:-1]}", f"Basic {TOKEN}", TOKEN):
                r = http.post("/v1/search", json={"query": "lakes"}, headers={"Authorization": attempt})
                responses.append(r.text)
                assert r.status_code == 401
            responses += [http.get("/metrics").text, http.get("/healthz").text]
            answer_id = json.loads(responses[0])["answer_id"]
            responses.append(http.get(f"/v1/lineage/answers/{answer_id}", headers=auth).text)
    finally:
        serve.send_signal(signal.SIGTERM)  # drains the audit log
        serve.wait(60)
    outputs["serve"] = (tmp_path / "serve.log").read_text()
    audit = Lake.at(lake, _settings(env)).read(ANSWERS).to_pylist()
    outputs["audit"] = json.dumps(audit, default=str)
    outputs["lineage_events"] = lineage_events.read_text()
    outputs["responses"] = "\n".join(responses)
    outputs["lineage_cli"] = cli("lineage", "answer", answer_id, "--lake", lake, "--json", env=env).stdout

    # Positive controls: the secrets were in use, and the net caught what -v would print.
    assert f"Bearer {API_KEY}" in stub.auth or any(API_KEY in a for a in stub.auth), stub.auth[:3]
    assert len(audit) == 4 and {r["status"] for r in audit} == {"answered", "failed"}
    assert "refused the request: HTTP 401" in outputs["responses"] and "***" in outputs["responses"]
    assert "***" in outputs["index"] + outputs["ingest"] + outputs["serve"], "botocore's -v lines carry the token"
    leaks = [(where, secret) for where, text in outputs.items() for secret in SECRETS if secret in text]
    assert not leaks, leaks
    assert "Traceback" not in outputs["serve"], outputs["serve"][-3000:]


def _settings(env: dict[str, str]):  # type: ignore[no-untyped-def]
    from pipelines.storage import ObjectStoreSettings

    return ObjectStoreSettings.from_env(env)
