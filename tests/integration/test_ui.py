"""The lineage explorer (``/ui``) in a real headless Chromium (Debian's, driven by selenium
through Debian's chromedriver; nothing downloaded).

A staff member asks, follows the answer to its page and a citation to its source row, and
sees a later update and delete on that row's timeline; an auditor sees the operations
page; an outsider's browser never holds a restricted title or text anywhere in the DOM,
whatever page it opens. ``STREAMRAG_UI_SCREENSHOTS=DIR`` keeps the screenshots (the
README's come from here).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from indexing.store import LocalStore
from pipelines.lake import DEAD_LETTERS, DEAD_LETTERS_SCHEMA
from pipelines.lake_writer import LakeWriter
from retrieval.answer import Answerer, AnswerOptions
from retrieval.api import create_app
from retrieval.audit import AuditLog
from retrieval.auth import Tokens
from retrieval.cache import ShardCache
from retrieval.engine import SearchEngine
from retrieval.lineage import Lineage
from retrieval.views import EngineOptions
from serving.fake_embedder import FakeEmbedder
from tests.retrieval.lakes import Doc, DocLake
from tests.retrieval.test_hybrid import build
from tests.retrieval.test_probes import run

pytestmark = pytest.mark.integration

SAM, ADA, ALICE = "token-sam-staff-member-01", "token-ada-the-auditor-002", "token-alice-public-only-3"
SECRET_TITLE = "Bluebird acquisition memo"
SECRET_TEXT = "Project Bluebird: the board approved buying Quokka Systems for 42 million."
DOCS = [
    Doc(1, "Kafka keeps an ordered log of events. Consumers read the log at their own pace and commit offsets."),
    Doc(2, "Delta Lake stores tables as Parquet files with a transaction log that records every commit."),
    Doc(3, "A vector index groups embeddings into lists so that a query scans only the nearest lists."),
    Doc(4, f"{SECRET_TITLE}. {SECRET_TEXT}", ("staff",)),
]
QUESTION = "How do consumers read the Kafka log?"


def browser() -> Any:
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.fail("chromium and chromedriver are needed (make test installs them with apt)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or ""
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000",
                 "--disable-gpu", "--no-first-run", "--disable-extensions"):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, ray_local: None) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ui")
    embedder = FakeEmbedder(dim=32)
    lake = DocLake(str(tmp / "lake"), embedder)
    lake.write(DOCS)
    build(lake, tmp / "index", nlist=2)
    letter = {"topic": ["cdc.app.public.docs"], "partition": [0], "offset": [41], "key": [b"{}"], "value": [b"{nope"],
              "error": ["value is not valid JSON: Expecting property name"], "headers": [None],
              "ingest_time": [datetime.now(UTC)], "writer": [None], "writer_seq": [None]}  # fmt: skip
    LakeWriter(lake.lake, DEAD_LETTERS, "ui-test", None).write(pa.Table.from_pydict(letter, DEAD_LETTERS_SCHEMA))
    engine = SearchEngine(lake.lake, LocalStore(str(tmp / "index")), embedder, ShardCache(tmp / "cache"),
                          EngineOptions(nprobe=2, prefetch=False, tail_poll_s=0.2))  # fmt: skip
    engine.start(background=True)
    tokens = tmp / "tokens.json"
    tokens.write_text(json.dumps({"tokens": {SAM: {"principal": "sam", "groups": ["staff"]},
                                             ADA: {"principal": "ada", "groups": ["auditor"]},
                                             ALICE: {"principal": "alice", "groups": []}}}))  # fmt: skip
    audit = AuditLog(engine.lake, flush_s=0.1)
    audit.start()
    answerer = Answerer(engine, None, audit, options=AnswerOptions(style="extract"))
    server = run(create_app(engine, Tokens.load(tokens), answerer, Lineage(engine.lake, audit)))
    shots = Path(os.environ.get("STREAMRAG_UI_SCREENSHOTS") or tmp / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    yield {"url": server.url, "lake": lake, "engine": engine, "shots": shots}
    server.stop()
    audit.stop()
    engine.stop()


def wait_for(driver: Any, css: str, timeout: float = 20, text: str | None = None) -> Any:
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in driver.find_elements(By.CSS_SELECTOR, css) if text is None or text in e.text]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(
        f"no {css!r} with {text!r} after {timeout} s; page:\n{driver.find_element(By.TAG_NAME, 'body').text[:2000]}"
    )


def sign_in(driver: Any, url: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{url}/ui")
    wait_for(driver, "#login")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#login button").click()


def type_into(driver: Any, element_id: str, text: str) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, element_id)
    box.clear()
    box.send_keys(text)


def test_question_to_answer_to_source_row_and_its_later_changes(site: dict[str, Any], caplog: Any) -> None:
    from selenium.webdriver.common.by import By

    caplog.set_level(logging.INFO, logger="retrieval.answer")

    driver = browser()
    try:
        sign_in(driver, site["url"], SAM)
        wait_for(driver, "#who", text="sam (staff)")
        type_into(driver, "query", "Kafka log consumers")
        driver.find_element(By.CSS_SELECTOR, "#search-form button").click()
        first = wait_for(driver, "#results .result")
        assert "public.docs pk=1" in first.text and "kafka" in first.text
        type_into(driver, "question", QUESTION)
        driver.find_element(By.CSS_SELECTOR, "#ask-form button").click()
        wait_for(driver, "#answer .sentence")
        assert "Consumers read the log" in driver.find_element(By.ID, "answer").text
        driver.save_screenshot(str(site["shots"] / "ask.png"))

        driver.find_element(By.ID, "answer-link").click()  # the answer's own page
        wait_for(driver, "h1", text=QUESTION)
        page = driver.find_element(By.TAG_NAME, "main").text
        assert "still current" in page and "kafka" in page and "lake version" in page and "embedder" in page
        driver.save_screenshot(str(site["shots"] / "answer.png"))
        answer_url = driver.current_url
        assert answer_url.split("/ui/", 1)[1] in caplog.text  # the service's log links to the page

        wait_for(driver, ".source a.source-link", text="pk=1").click()  # a citation → its source row
        wait_for(driver, "#timeline .version")
        assert [v.get_attribute("data-kind") for v in driver.find_elements(By.CSS_SELECTOR, "#timeline .version")] == [
            "insert"
        ]
        assert QUESTION in driver.find_element(By.TAG_NAME, "main").text  # the answer that used it

        lake, engine = site["lake"], site["engine"]
        old = DOCS[0]
        lake.write([old], op="delete")  # an update, as the ingest job writes one
        lake.write([Doc(1, old.text + " Offsets are stored in a topic of their own.")])
        version = lake.write([Doc(1, old.text + " Offsets are stored in a topic of their own.")], op="delete")
        deadline = time.monotonic() + 20
        while engine.current_view().lake_version < version and time.monotonic() < deadline:
            time.sleep(0.1)
        driver.refresh()
        wait_for(driver, "#row-status", text="deleted")
        kinds = [v.get_attribute("data-kind") for v in driver.find_elements(By.CSS_SELECTOR, "#timeline .version")]
        assert kinds[0] == "insert" and kinds[-1] == "delete" and "update" in kinds, kinds
        versions = driver.find_elements(By.CSS_SELECTOR, "#timeline .version")  # the answer used the first version
        assert QUESTION in versions[0].text and all(QUESTION not in v.text for v in versions[1:])
        driver.save_screenshot(str(site["shots"] / "source.png"))

        driver.get(answer_url)  # the answer's source is now marked deleted
        wait_for(driver, ".badge.deleted")
    finally:
        driver.quit()


def test_an_auditor_sees_operations_and_a_staff_member_does_not(site: dict[str, Any]) -> None:
    driver = browser()
    try:
        sign_in(driver, site["url"], ADA)
        wait_for(driver, "#nav-ops:not([hidden])").click()
        wait_for(driver, "#dead-letters", text="value is not valid JSON")
        assert "index version" in wait_for(driver, "#health").text
        driver.save_screenshot(str(site["shots"] / "ops.png"))
        driver.execute_script("sessionStorage.clear()")
        sign_in(driver, site["url"], SAM)
        wait_for(driver, "#who", text="sam")
        assert not driver.find_element("id", "nav-ops").is_displayed()
        driver.get(f"{site['url']}/ui/ops")
        wait_for(driver, ".error", text="not found")
        assert "value is not valid JSON" not in driver.page_source
    finally:
        driver.quit()


def test_an_outsiders_browser_never_holds_a_restricted_title_or_text(site: dict[str, Any]) -> None:
    from selenium.webdriver.common.by import By

    secret = Doc(4, f"{SECRET_TITLE}. {SECRET_TEXT}", ("staff",))
    insider = browser()
    try:  # a staff member's answer that used the restricted document
        sign_in(insider, site["url"], SAM)
        wait_for(insider, "#who", text="sam")
        type_into(insider, "question", "What did the board approve about Quokka Systems?")
        insider.find_element(By.CSS_SELECTOR, "#ask-form button").click()
        wait_for(insider, "#answer-link")
        assert "Bluebird" in insider.find_element(By.ID, "answer").text  # the insider does see it
        answer_id = insider.find_element(By.ID, "answer-link").get_attribute("href").rsplit("/", 1)[-1]
    finally:
        insider.quit()

    driver = browser()
    seen: list[str] = []
    try:
        sign_in(driver, site["url"], ALICE)
        wait_for(driver, "#who", text="alice")
        for query, mode in ((SECRET_TITLE, "hybrid"), ("Bluebird Quokka board", "keyword"), (SECRET_TEXT, "dense")):
            type_into(driver, "query", query)
            driver.find_element(By.ID, "mode").send_keys(mode)
            driver.find_element(By.CSS_SELECTOR, "#search-form button").click()
            time.sleep(1.0)
            seen.append(driver.page_source)
        type_into(driver, "question", "What did the board approve?")  # (what she typed is shown back)
        driver.find_element(By.CSS_SELECTOR, "#ask-form button").click()
        wait_for(driver, "#answer-link")
        seen.append(driver.page_source)
        for path in (f"/ui/answers/{answer_id}", f"/ui/sources/public.docs/{secret.pk}", "/ui/ops",
                     f"/ui/sources/public.docs/{secret.pk}/x"):  # fmt: skip
            driver.get(site["url"] + path)
            time.sleep(1.0)
            seen.append(driver.page_source)
        assert "not visible to you" in seen[4] or "no answer" in seen[4]
    finally:
        driver.quit()
    for page in seen:
        for word in ("Bluebird", "Quokka Systems", "42 million", secret.chunk_id):
            assert word not in page, (word, page[:3000])
