// streamrag's lineage explorer: every view reads the same HTTP API as any client, with the
// caller's bearer token (kept in this tab's sessionStorage only). The server decides what a
// caller may see; this page never holds more than the API returned to that caller, and it
// writes every value as text (textContent), never as HTML.
"use strict";

const TOKEN_KEY = "streamrag-token";
const main = () => document.getElementById("main");

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function show(...nodes) {
  main().replaceChildren(...nodes);
}

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, body) {
  const headers = { Authorization: `Bearer ${sessionStorage.getItem(TOKEN_KEY) || ""}` };
  const init = { headers };
  if (body !== undefined) {
    init.method = "POST";
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (response.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    login("That token was not accepted.");
    throw new ApiError(401, "signed out");
  }
  const data = await response.json().catch(() => ({ error: `HTTP ${response.status}` }));
  if (!response.ok) throw new ApiError(response.status, data.error || `HTTP ${response.status}`);
  return data;
}

function failure(err) {
  if (err instanceof ApiError && err.status === 401) return null;
  return el("p", { class: "error", role: "alert" }, err.message || String(err));
}

function enc(part) {
  return encodeURIComponent(part);
}

function sourceHref(table, pk) {
  return `/ui/sources/${enc(table)}/${enc(pk)}`;
}

function chain(source, extra) {
  const kafka = source.kafka || {};
  return el(
    "div",
    { class: "chain" },
    el("span", {}, "source row ", el("a", { href: sourceHref(source.table, source.pk), class: "source-link" }, `${source.table} pk=${source.pk}`)),
    el("span", {}, `position ${source.position}`),
    el("span", {}, `kafka ${kafka.topic}/${kafka.partition}@${kafka.offset}`),
    ...(extra || []).map((text) => el("span", {}, text)),
  );
}

// -- sign in -------------------------------------------------------------------------------

function login(message) {
  document.getElementById("who").textContent = "";
  document.getElementById("signout").hidden = true;
  document.getElementById("nav-ops").hidden = true;
  const token = el("input", { type: "password", id: "token", placeholder: "bearer token", autocomplete: "off", required: true });
  show(
    el(
      "section",
      {},
      el("h1", {}, "Sign in"),
      el("p", { class: "muted" }, "Paste the bearer token the service's tokens file gives you. It stays in this tab only."),
      message ? el("p", { class: "error" }, message) : null,
      el(
        "form",
        {
          id: "login",
          onsubmit: (event) => {
            event.preventDefault();
            sessionStorage.setItem(TOKEN_KEY, token.value.trim());
            route();
          },
        },
        token,
        el("button", { type: "submit" }, "Sign in"),
      ),
    ),
  );
}

// -- ask and search ----------------------------------------------------------------------------

function home() {
  const query = el("input", { type: "text", id: "query", placeholder: "search the documents", required: true });
  const mode = el("select", { id: "mode" }, ["hybrid", "dense", "keyword"].map((m) => el("option", { value: m }, m)));
  const k = el("input", { type: "number", id: "k", min: 1, max: 100, value: 5, title: "results" });
  const asOf = el("input", { type: "number", id: "as-of", min: 0, placeholder: "as_of", title: "lake version (time travel)" });
  const results = el("div", { id: "results" });
  const question = el("input", { type: "text", id: "question", placeholder: "ask a question", required: true });
  const style = el("select", { id: "style" }, el("option", { value: "" }, "service default"), el("option", { value: "extract" }, "extract"), el("option", { value: "generate" }, "generate"));
  const answer = el("div", { id: "answer" });
  show(
    el(
      "section",
      {},
      el("h2", {}, "Search"),
      el("form", { id: "search-form", onsubmit: (e) => { e.preventDefault(); search(query.value, mode.value, k.value, asOf.value, results); } }, query, mode, k, asOf, el("button", { type: "submit" }, "Search")),
      results,
    ),
    el(
      "section",
      {},
      el("h2", {}, "Ask"),
      el("form", { id: "ask-form", onsubmit: (e) => { e.preventDefault(); ask(question.value, style.value, answer); } }, question, style, el("button", { type: "submit" }, "Ask")),
      answer,
    ),
  );
}

async function search(query, mode, k, asOf, into) {
  into.replaceChildren(el("p", { class: "muted" }, "Searching…"));
  const body = { query, mode, k: Number(k) || 5 };
  if (asOf !== "") body.as_of = Number(asOf);
  try {
    const data = await api("/v1/search", body);
    if (!data.results.length) {
      into.replaceChildren(el("p", { class: "muted" }, "Nothing found."));
      return;
    }
    into.replaceChildren(
      el("p", { class: "muted small" }, `index version ${data.index_version}, lake version ${data.lake_version}, ${data.results.length} results`),
      ...data.results.map((r) =>
        el(
          "div",
          { class: "result" },
          el("strong", { class: "title" }, r.title || r.doc_id),
          el("span", { class: "muted small" }, `  score ${r.score.toFixed(3)} · ${r.origin}`),
          el("div", { class: "text" }, r.text),
          chain(r.source, [`lake version ${r.lake_version}`, `index version ${r.index_version}`]),
        ),
      ),
    );
  } catch (err) {
    into.replaceChildren(failure(err) || "");
  }
}

async function ask(question, style, into) {
  const streamed = el("div", { class: "stream", id: "streamed" });
  into.replaceChildren(streamed);
  const body = { question, stream: true };
  if (style) body.style = style;
  try {
    const response = await fetch("/v1/answer", {
      method: "POST",
      headers: { Authorization: `Bearer ${sessionStorage.getItem(TOKEN_KEY) || ""}`, "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    if (!response.ok) {
      const data = await response.json().catch(() => ({}));
      if (response.status === 401) return login("That token was not accepted.");
      throw new ApiError(response.status, data.error || `HTTP ${response.status}`);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const name = (frame.match(/^event: (.*)$/m) || [])[1];
        const data = JSON.parse((frame.match(/^data: (.*)$/m) || [])[1] || "{}");
        if (name === "token") streamed.append(data.text);
        else if (name === "done") into.replaceChildren(renderAnswer(data));
        else if (name === "error") throw new ApiError(502, `${data.error} (answer ${data.answer_id})`);
      }
    }
  } catch (err) {
    into.append(failure(err) || "");
  }
}

function sentenceNode(sentence) {
  return el(
    "p",
    { class: sentence.flagged ? "sentence flagged" : "sentence" },
    sentence.text,
    (sentence.sources || []).map((n) => el("a", { class: "marker", href: `#source-${n}` }, `[${n}]`)),
    sentence.flagged ? el("span", { class: "flag" }, "unsupported: no source supports it") : null,
  );
}

function renderAnswer(data) {
  const sentences = (data.sentences || []).filter((s) => !s.dropped);
  return el(
    "div",
    { class: "answer" },
    data.no_answer ? el("p", { class: "muted" }, data.answer) : sentences.map(sentenceNode),
    el("h3", {}, "Citations"),
    (data.citations || []).map((c) =>
      el(
        "div",
        { class: "source", id: `source-${c.n}` },
        el("strong", {}, `[${c.n}] ${c.title || c.doc_id}`),
        el("span", { class: "muted small" }, ` support ${Number(c.support).toFixed(2)}`),
        chain(c.source, [`lake version ${c.lake_version}`, `index version ${c.index_version}`]),
      ),
    ),
    el("p", {}, el("a", { href: `/ui/answers/${enc(data.answer_id)}`, id: "answer-link" }, "Answer page (lineage)"), el("span", { class: "muted small" }, ` ${data.answer_id} · ${data.style} · ${data.model || ""}`)),
  );
}

// -- an answer's lineage -------------------------------------------------------------------------

async function answerPage(id) {
  show(el("p", { class: "muted" }, "Loading the answer…"));
  let data;
  try {
    data = await api(`/v1/lineage/answers/${enc(id)}`);
  } catch (err) {
    return show(failure(err) || "");
  }
  const cited = new Set((data.citations || []).map((c) => c.n));
  show(
    el(
      "section",
      {},
      el("h1", {}, data.question),
      el("p", { class: "muted small" }, `answer ${data.answer_id} · ${data.time || ""} · asked by ${data.principal} · ${data.style} · ${data.mode} · ${data.status}`),
      (data.sentences || []).length ? data.sentences.filter((s) => !s.dropped).map(sentenceNode) : el("p", { class: "text" }, data.answer || data.error || ""),
      el(
        "p",
        { class: "chain" },
        el("span", {}, `lake version ${data.lake_version}`),
        el("span", {}, `index version ${data.index_version}`),
        el("span", {}, `embedder ${data.models.embedder || "-"}`),
        el("span", {}, `generator ${data.models.generator || "none (extractive)"}`),
      ),
    ),
    el(
      "section",
      {},
      el("h2", {}, "Sources in the prompt"),
      (data.sources || []).map((s) =>
        s.visible
          ? el(
              "div",
              { class: "source", id: `source-${s.n}` },
              el("strong", {}, `[${s.n}] ${s.title || s.doc_id}`),
              cited.has(s.n) ? el("span", { class: "badge current" }, "cited") : null,
              el("span", { class: `badge ${s.now}` }, s.now === "current" ? "still current" : s.now),
              el("div", { class: "text" }, s.text),
              el(
                "div",
                { class: "chain" },
                el("span", {}, `chunk ${s.chunk_id}`),
                el("span", {}, "source row ", el("a", { href: sourceHref(s.source.table, s.source.pk), class: "source-link" }, `${s.source.table} pk=${s.source.pk}`), ` position ${s.source.position}`),
                el("span", {}, `kafka ${s.source.kafka.topic}/${s.source.kafka.partition}@${s.source.kafka.offset}`),
                el("span", {}, `lake version ${s.lake_version}, index version ${data.index_version}`),
                el("span", {}, `model ${s.embedding_model || data.models.embedder || "-"}`),
              ),
            )
          : el("div", { class: "source", id: `source-${s.n}` }, el("span", { class: "muted" }, `[${s.n}] not visible to you`)),
      ),
    ),
  );
}

// -- a source row's history ------------------------------------------------------------------

async function sourcePage(table, pk) {
  show(el("p", { class: "muted" }, "Loading the source row…"));
  let data;
  try {
    data = await api(`/v1/lineage/sources/${enc(table)}/${pk.split("/").map(enc).join("/")}`);
  } catch (err) {
    return show(failure(err) || "");
  }
  // One entry per change (position): the chunk versions it wrote, in change order.
  const byPosition = new Map();
  for (const v of data.chunk_versions) {
    const key = v.source.position;
    if (!byPosition.has(key)) byPosition.set(key, []);
    byPosition.get(key).push(v);
  }
  const changes = [...byPosition.entries()].sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0));
  const lastAcl = new Map();
  // The answers whose prompt held one of these chunk versions (chunk id and position).
  const answersFor = (versions) =>
    data.answers.filter((a) => (a.versions || []).some((u) => versions.some((v) => v.chunk_id === u.chunk_id && v.source.position === u.position)));
  show(
    el(
      "section",
      {},
      el("h1", {}, `${data.table} pk=${data.pk}`),
      el("p", {}, el("span", { class: `badge ${data.status}`, id: "row-status" }, data.status), el("span", { class: "muted small" }, ` ${data.current_chunks.length} current chunk(s), ${changes.length} change(s)`)),
    ),
    el(
      "section",
      {},
      el("h2", {}, "Timeline"),
      el(
        "div",
        { class: "timeline", id: "timeline" },
        changes.map(([position, versions], i) => {
          const deletes = versions.filter((v) => v.op === "delete");
          const upserts = versions.filter((v) => v.op === "upsert");
          const aclChanged = upserts.some((v) => lastAcl.has(v.chunk_id) && lastAcl.get(v.chunk_id) !== v.acl.join(","));
          const kind = upserts.length === 0 ? "delete" : i === 0 ? "insert" : aclChanged ? "ACL change" : "update";
          for (const v of versions) lastAcl.set(v.chunk_id, v.acl.join(","));
          const used = answersFor(upserts);
          return el(
            "div",
            { class: `version ${upserts.length ? "upsert" : "delete"}`, "data-kind": kind },
            el("strong", {}, kind),
            el("span", { class: "muted small" }, ` position ${position} · ${versions[0].ingest_time || ""} · kafka ${versions[0].source.kafka.topic}@${versions[0].source.kafka.offset}`),
            el("div", { class: "small" }, `${upserts.length} chunk version(s) written, ${deletes.length} deleted`, upserts.length ? ` · ACL ${upserts[0].acl.join(", ") || "public"}` : ""),
            upserts.slice(0, 3).map((v) => el("div", { class: "text small" }, v.text)),
            used.length
              ? el("div", { class: "small" }, "used by: ", used.map((a) => el("a", { href: `/ui/answers/${enc(a.answer_id)}`, class: "answer-use" }, a.question)).flatMap((a, j) => (j ? [", ", a] : [a])))
              : null,
          );
        }),
      ),
    ),
    el(
      "section",
      {},
      el("h2", {}, "Answers that used this row"),
      data.answers.length
        ? el("table", {}, el("tr", {}, el("th", {}, "when"), el("th", {}, "question"), el("th", {}, "by"), el("th", {}, "cited")), data.answers.map((a) => el("tr", {}, el("td", {}, a.time || ""), el("td", {}, el("a", { href: `/ui/answers/${enc(a.answer_id)}` }, a.question)), el("td", {}, a.principal), el("td", {}, a.cited ? "yes" : "in the prompt"))))
        : el("p", { class: "muted" }, "None."),
    ),
  );
}

// -- operations ------------------------------------------------------------------------------------

async function opsPage() {
  show(el("p", { class: "muted" }, "Loading…"));
  try {
    const [health, letters] = await Promise.all([api("/healthz"), api("/v1/ops/dead-letters")]);
    show(
      el(
        "section",
        {},
        el("h1", {}, "Operations"),
        el(
          "table",
          { id: "health" },
          [
            ["status", health.status],
            ["index version", health.index_version],
            ["index covers lake version", health.index_lake_version],
            ["lake version read", health.lake_version],
            ["fresh rows in the tail", health.tail_rows],
            ["tail lag (s)", health.tail_lag_s],
            ["problems", (health.problems || []).join("; ") || "none"],
          ].map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v === undefined || v === null ? "-" : v))),
        ),
      ),
      el(
        "section",
        {},
        el("h2", {}, `Recent dead letters (${letters.dead_letters.length} of ${letters.total})`),
        letters.dead_letters.length
          ? el("table", { id: "dead-letters" }, el("tr", {}, el("th", {}, "when"), el("th", {}, "where"), el("th", {}, "why")), letters.dead_letters.map((d) => el("tr", {}, el("td", {}, d.ingest_time || ""), el("td", {}, `${d.topic}/${d.partition}@${d.offset}`), el("td", {}, d.error))))
          : el("p", { class: "muted" }, "None."),
      ),
    );
  } catch (err) {
    show(failure(err) || "");
  }
}

// -- routing ---------------------------------------------------------------------------------------

async function route() {
  if (!sessionStorage.getItem(TOKEN_KEY)) return login();
  let me;
  try {
    me = await api("/v1/whoami");
  } catch (err) {
    return err instanceof ApiError && err.status === 401 ? null : show(failure(err) || "");
  }
  document.getElementById("who").textContent = `${me.principal}${me.groups.length ? ` (${me.groups.join(", ")})` : ""}`;
  document.getElementById("signout").hidden = false;
  document.getElementById("nav-ops").hidden = !me.auditor;
  const parts = location.pathname.replace(/^\/ui\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  if (parts[0] === "answers" && parts[1]) return answerPage(parts.slice(1).join("/"));
  if (parts[0] === "sources" && parts.length >= 3) return sourcePage(parts[1], parts.slice(2).join("/"));
  if (parts[0] === "ops") return opsPage();
  return home();
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("signout").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    login();
  });
  route();
});
