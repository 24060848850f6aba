// detgate's records and replays page: plain DOM, no framework, no build step.
//
// What must stay true: every string that comes from a record reaches the page through
// text nodes (textContent, createTextNode) or attribute values we choose, never as HTML;
// links are only the "#/..." routes built here. The CSP's Trusted Types make any
// innerHTML assignment throw, so a slip fails loudly instead of running a record's markup.
"use strict";

const KEY_SLOT = "detgate.apiKey"; // sessionStorage: this tab only, never in a URL
const PAGE_SIZE = 25;
const MAX_LOAD = 64;

// ---- DOM helpers -------------------------------------------------------------------

const TIPS = new WeakMap(); // element -> () => Node, the hover card's content

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

function setAttrs(node, attrs) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "tip") TIPS.set(node, value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "href") node.setAttribute("href", route(value));
    else node.setAttribute(name, value === true ? "" : String(value));
  }
}

function append(node, children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

// Only in-page routes are ever linked: a record cannot smuggle in a javascript: URL.
function route(path) {
  if (typeof path !== "string" || !path.startsWith("#/")) throw new Error("not a route");
  return path;
}

function show(...nodes) {
  const main = document.getElementById("main");
  main.replaceChildren(...nodes);
  hideTip();
}

// ---- API -----------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function api(method, path, body) {
  const headers = { Accept: "application/json" };
  const key = sessionStorage.getItem(KEY_SLOT);
  if (key) headers.Authorization = "Bearer " + key;
  const init = { method, headers, cache: "no-store", credentials: "omit" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const resp = await fetch(path, init);
  let data = null;
  try {
    data = await resp.json();
  } catch (_) {
    data = null;
  }
  if (!resp.ok) {
    const err = (data && data.error) || {};
    throw new ApiError(resp.status, err.message || resp.statusText, err.code || null);
  }
  return data;
}

// ---- formatting ----------------------------------------------------------------------

const fmtTime = (t) => (typeof t === "number" ? new Date(t * 1000).toLocaleString() : "");
const fmtLp = (x) => (x === null || x === undefined ? "—" : String(x));
const fmtSci = (x) => {
  if (x === null || x === undefined) return "—";
  if (x === 0) return "0";
  return Math.abs(x) >= 1e-3 && Math.abs(x) < 1e4 ? x.toPrecision(4) : x.toExponential(3);
};
const short = (s, n = 14) => (typeof s === "string" && s.length > n ? s.slice(0, n) + "…" : s);

// Control characters other than newline and tab as \xNN: visible, and in every font.
const visible = (text) => String(text).replace(/[\u0000-\u0008\u000b-\u001f\u007f]/g,
  (c) => "\\x" + c.charCodeAt(0).toString(16).padStart(2, "0"));

// A token as it reads in a chip: newlines and tabs as arrows, nothing collapsed.
function tokenLabel(text, id) {
  if (text === null || text === undefined) return "#" + id;
  if (text === "") return "∅";
  return visible(text).replace(/\n/g, "↵").replace(/\t/g, "⇥");
}

function badge(kind, label) {
  return el("span", { class: "badge " + kind }, label || kind);
}

function resultOf(cmp) {
  return cmp.match ? badge("match", "exact match") : badge("diverged", "diverged");
}

function lastReplay(record) {
  const replays = record.replays || [];
  return replays.length ? replays[replays.length - 1] : null;
}

function tokenCount(record) {
  if (record.usage && typeof record.usage.completion_tokens === "number") {
    return record.usage.completion_tokens;
  }
  return (record.choices || []).reduce((n, c) => n + (c.token_ids || []).length, 0);
}

// ---- hover card ----------------------------------------------------------------------

function showTip(target) {
  const make = TIPS.get(target);
  if (!make) return;
  const tip = document.getElementById("tooltip");
  tip.replaceChildren(make());
  tip.hidden = false;
  const box = target.getBoundingClientRect();
  const left = Math.min(box.left, window.innerWidth - tip.offsetWidth - 8);
  const below = box.bottom + 6 + tip.offsetHeight < window.innerHeight;
  tip.style.left = Math.max(4, left) + "px";
  tip.style.top = (below ? box.bottom + 6 : box.top - tip.offsetHeight - 6) + "px";
}

function hideTip() {
  const tip = document.getElementById("tooltip");
  if (tip) tip.hidden = true;
}

function tipRows(rows) {
  return el("table", null, rows.map(([k, v]) => el("tr", null, el("th", null, k), el("td", null, v))));
}

document.addEventListener("mouseover", (ev) => {
  const target = ev.target instanceof Element ? ev.target.closest(".has-tip") : null;
  if (target) showTip(target);
  else hideTip();
});

// ---- views -----------------------------------------------------------------------------

function keyForm(message) {
  const input = el("input", { type: "password", id: "api-key", autocomplete: "off",
                              placeholder: "API key", "aria-label": "API key" });
  const form = el("form", { class: "card keyform", id: "key-form" },
    el("h1", null, "API key"),
    el("p", null, "This gateway needs an API key. It is kept in this tab's session storage " +
                  "and sent as a Bearer header, nowhere else."),
    message ? el("p", { class: "error" }, message) : null,
    input,
    el("button", { type: "submit" }, "Use key"));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (!input.value.trim()) return;
    sessionStorage.setItem(KEY_SLOT, input.value.trim());
    render();
  });
  show(form);
  input.focus();
}

function failure(err, what) {
  if (err instanceof ApiError && err.status === 401) {
    keyForm(sessionStorage.getItem(KEY_SLOT) ? err.message : null);
    return;
  }
  if (err instanceof ApiError && err.status === 404) {
    show(el("div", { class: "card", id: "not-found" },
      el("h1", { class: "notfound" }, what + " not found"),
      el("p", { class: "muted" }, err.message),
      el("a", { href: "#/" }, "← all records")));
    return;
  }
  show(el("div", { class: "card error", id: "load-error" }, "Could not load: " + err.message));
}

function listHash(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v) q.set(k, v);
  const s = q.toString();
  return "#/" + (s ? "?" + s : "");
}

async function viewList(params) {
  const query = new URLSearchParams({ limit: String(PAGE_SIZE) });
  for (const k of ["limit", "status", "replay", "after"]) {
    if (params.get(k)) query.set(k, params.get(k));
  }
  const page = await api("GET", "/v1/requests?" + query.toString());
  const current = { limit: params.get("limit"), status: params.get("status"),
                    replay: params.get("replay") };

  const select = (name, label, options) => {
    const s = el("select", { id: "filter-" + name, "aria-label": label },
      options.map(([value, text]) => {
        const o = el("option", { value }, text);
        if ((current[name] || "") === value) o.selected = true;
        return o;
      }));
    s.addEventListener("change", () => {
      location.hash = listHash({ ...current, [name]: s.value });
    });
    return el("label", null, label + " ", s);
  };

  const rows = page.data.map((r) => {
    const last = lastReplay(r);
    return el("tr", { class: "record-row", "data-id": r.id },
      el("td", null, fmtTime(r.created)),
      el("td", { class: "mono" }, el("a", { href: "#/records/" + encodeURIComponent(r.id) }, r.id)),
      el("td", { class: "mono" }, r.endpoint === "/v1/chat/completions" ? "chat" : "completions"),
      el("td", null, r.model),
      el("td", { class: "mono", title: r.system_fingerprint || "" }, short(r.system_fingerprint) || "—"),
      el("td", null, badge(r.status)),
      el("td", { class: "num" }, tokenCount(r)),
      el("td", { class: "num" }, (r.replays || []).length),
      el("td", { class: "last-replay" }, last ? resultOf(last) : badge("none", "—")));
  });

  const table = el("table", { id: "records" },
    el("thead", null, el("tr", null,
      ["Created", "Record", "Endpoint", "Model", "Fingerprint", "Status"].map((t) => el("th", null, t)),
      el("th", { class: "num" }, "Tokens"), el("th", { class: "num" }, "Replays"),
      el("th", null, "Last replay"))),
    el("tbody", null, rows));

  const pager = el("div", { class: "pager" },
    params.get("after") ? el("a", { href: listHash(current), id: "newest" }, "⇤ newest") : null,
    page.has_more && page.last_id
      ? el("a", { href: listHash({ ...current, after: page.last_id }), id: "older" }, "older →")
      : null);

  show(
    el("h1", null, "Records"),
    el("div", { class: "filters" },
      select("status", "Status", [["", "any"], ["complete", "complete"], ["aborted", "aborted"],
                                  ["failed", "failed"]]),
      select("replay", "Last replay", [["", "any"], ["match", "exact match"],
                                       ["diverged", "diverged"], ["none", "never replayed"]])),
    page.data.length ? table : el("p", { class: "card muted", id: "no-records" }, "No records here."),
    pager);
}

const SAMPLING = ["temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "n",
                  "seed", "stop", "presence_penalty", "frequency_penalty", "logprobs",
                  "top_logprobs", "prompt_logprobs", "stream"];

function contentText(content) {
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    return content.map((p) => (p && p.type === "text" ? p.text : JSON.stringify(p))).join("\n");
  }
  return JSON.stringify(content);
}

function requestCard(record) {
  const req = record.request || {};
  const parts = [];
  if (Array.isArray(req.messages)) {
    for (const m of req.messages) {
      parts.push(el("div", { class: "message" },
        el("div", { class: "role" }, String(m.role)),
        el("pre", { class: "content" }, contentText(m.content))));
    }
  } else if (req.prompt !== undefined) {
    parts.push(el("div", { class: "message" }, el("div", { class: "role" }, "prompt"),
      el("pre", { class: "content" }, typeof req.prompt === "string" ? req.prompt
        : "token ids: " + JSON.stringify(req.prompt))));
  }
  const facts = [];
  for (const k of SAMPLING) {
    if (req[k] === undefined) continue;
    const label = k === "seed" ? "seed (effective)" : k;
    facts.push(el("dt", null, label), el("dd", { class: "mono", id: "param-" + k },
                                         JSON.stringify(req[k])));
  }
  if (req.seed === undefined) {
    facts.push(el("dt", null, "seed (effective)"), el("dd", { id: "param-seed" }, "none: greedy"));
  }
  return el("div", { class: "grid2" },
    el("div", { class: "card", id: "request" }, el("h2", null, "Request"), parts),
    el("div", { class: "card" }, el("h2", null, "Sampling"), el("dl", { class: "facts" }, facts)));
}

function tokenTip(choice, i) {
  return () => {
    const rows = [["position", String(i)], ["token id", String((choice.token_ids || [])[i])],
                  ["text", JSON.stringify((choice.tokens || [])[i] ?? null)],
                  ["logprob", fmtLp((choice.logprobs || [])[i])]];
    const top = (choice.top_logprobs || [])[i] || [];
    const box = el("div", null, tipRows(rows));
    if (top.length) {
      box.append(el("div", { class: "muted" }, "top logprobs"),
                 tipRows(top.map((t) => [JSON.stringify(t.token), fmtLp(t.logprob)])));
    }
    return box;
  };
}

function tokenChips(choice, idPrefix) {
  const ids = choice.token_ids || [];
  const lps = choice.logprobs || [];
  const n = Math.max(ids.length, (choice.tokens || []).length);
  const chips = [];
  for (let i = 0; i < n; i++) {
    const lp = lps[i];
    chips.push(el("span", {
      class: "tok has-tip" + (typeof lp === "number" && lp < -5 ? " low" : ""),
      id: idPrefix + i, "data-pos": i, tip: tokenTip(choice, i),
    }, tokenLabel((choice.tokens || [])[i], ids[i])));
  }
  return el("div", { class: "tokens" }, chips);
}

function answerCard(record) {
  const choices = record.choices || [];
  const body = choices.map((c) => el("div", { class: "choice", "data-index": c.index },
    el("p", { class: "muted" }, `choice ${c.index} · finish_reason ${c.finish_reason} · ` +
                               `${(c.token_ids || []).length} tokens`),
    tokenChips(c, `tok-${c.index}-`),
    el("details", null, el("summary", null, "as text"), el("pre", { class: "answer-text" }, c.text))));
  if (record.error) body.push(el("p", { class: "error" }, "error: " + record.error));
  return el("div", { class: "card", id: "answer" }, el("h2", null, "Answer"),
    body.length ? body : el("p", { class: "muted" }, "No tokens."));
}

function replayNow(record) {
  const load = el("input", { type: "number", id: "replay-load", min: 0, max: MAX_LOAD, value: 16,
                             "aria-label": "load" });
  const button = el("button", { type: "submit", id: "replay-now" }, "Replay now");
  const status = el("span", { class: "muted", id: "replay-status" });
  const form = el("form", { class: "replay-now" },
    el("label", null, "load ", load), button, status,
    el("span", { class: "muted" }, "other requests sent to the same worker at the same time"));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const k = Number(load.value || 0);
    button.disabled = true;
    status.className = "muted";
    status.textContent = "replaying…";
    try {
      const cmp = await api("POST", "/replay/" + encodeURIComponent(record.id), { load: k });
      location.hash = `#/records/${encodeURIComponent(record.id)}/replays/${encodeURIComponent(cmp.replay_id)}`;
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) return failure(err, "Record");
      status.className = "error";
      status.textContent = "replay failed: " + err.message;
      button.disabled = false;
    }
  });
  if (record.status !== "complete") {
    button.disabled = true;
    status.textContent = `a ${record.status} record cannot be replayed`;
  }
  return form;
}

function replaysCard(record) {
  const replays = (record.replays || []).slice().reverse();
  const rows = replays.map((c) => el("tr", { class: "replay-row", "data-replay": c.replay_id },
    el("td", null, fmtTime(c.created)),
    el("td", { class: "mono" }, el("a", {
      href: `#/records/${encodeURIComponent(record.id)}/replays/${encodeURIComponent(c.replay_id)}`,
    }, c.replay_id)),
    el("td", { class: "num" }, c.load),
    el("td", null, resultOf(c)),
    el("td", { class: "num" }, c.first_divergence ?? "—"),
    el("td", { class: "num" }, fmtSci(c.max_abs_logprob_diff)),
    el("td", { class: "num" }, fmtSci(c.logprob_mse)),
    el("td", { class: "mono", title: c.replay_fingerprint || "" }, short(c.replay_fingerprint))));
  return el("div", { class: "card", id: "replays" }, el("h2", null, "Replays"), replayNow(record),
    rows.length ? el("table", null,
      el("thead", null, el("tr", null, ["When", "Replay", "Load", "Result", "First divergence",
                                        "max |Δ logprob|", "logprob MSE", "Fingerprint"]
        .map((t) => el("th", null, t)))),
      el("tbody", null, rows)) : el("p", { class: "muted" }, "Not replayed yet."));
}

// A worker's machine in one line (the fingerprint decides where a record replays; this is
// what it ran on): "AMD EPYC, x86-64 avx2+fma, 2 threads, torch 2.13.0+cpu".
function fmtMachine(m) {
  if (!m || typeof m !== "object") return "—";
  const parts = [m.gpu || m.cpu, m.isa_class,
                 m.torch_threads != null ? `${m.torch_threads} threads` : null,
                 m.cpu_kernels ? `kernels ${m.cpu_kernels}` : null,
                 m.torch ? `torch ${m.torch}` : null];
  return parts.filter((p) => p != null && p !== "").map(String).join(", ");
}

async function viewRecord(id) {
  const record = await api("GET", "/v1/requests/" + encodeURIComponent(id));
  const u = record.usage || {};
  show(
    el("p", null, el("a", { href: "#/" }, "← all records")),
    el("h1", null, "Record ", el("span", { class: "mono", id: "record-id" }, record.id)),
    el("div", { class: "card" }, el("dl", { class: "facts" },
      el("dt", null, "created"), el("dd", null, fmtTime(record.created)),
      el("dt", null, "endpoint"), el("dd", { class: "mono" }, record.endpoint),
      el("dt", null, "model"), el("dd", null, record.model),
      el("dt", null, "status"), el("dd", null, badge(record.status)),
      el("dt", null, "worker"), el("dd", { class: "mono", id: "worker" }, record.worker || "—"),
      el("dt", null, "fingerprint"), el("dd", { class: "mono", id: "fingerprint" },
                                         record.system_fingerprint || "—"),
      el("dt", null, "machine"), el("dd", { id: "machine" }, fmtMachine(record.machine)),
      el("dt", null, "usage"), el("dd", null,
        `${u.prompt_tokens ?? "?"} prompt + ${u.completion_tokens ?? "?"} completion tokens`))),
    requestCard(record),
    answerCard(record),
    replaysCard(record));
}

// ---- comparison ----------------------------------------------------------------------

function deltas(a, b, upto) {
  const out = [];
  for (let i = 0; i < upto; i++) {
    const x = (a.logprobs || [])[i];
    const y = (b.logprobs || [])[i];
    out.push(typeof x === "number" && typeof y === "number" ? Math.abs(x - y) : null);
  }
  return out;
}

function firstDivergence(a, b) {
  const x = a.token_ids || [];
  const y = b.token_ids || [];
  for (let i = 0; i < Math.min(x.length, y.length); i++) if (x[i] !== y[i]) return i;
  return x.length === y.length ? null : Math.min(x.length, y.length);
}

function alignTable(a, b, div, d) {
  const n = Math.max((a.token_ids || []).length, (b.token_ids || []).length);
  const head = [el("th", null, "")];
  const rowA = [el("td", { class: "side" }, "original")];
  const rowB = [el("td", { class: "side" }, "replay")];
  for (let i = 0; i < n; i++) {
    let kind = "same";
    if (div !== null && i === div) kind = "diverged";
    else if (div !== null && i > div) kind = "after";
    else if (d[i] !== null && d[i] !== undefined && !Object.is(a.logprobs[i], b.logprobs[i])) kind = "lpdiff";
    const mark = i === div ? " first-divergence" : "";
    head.push(el("th", { class: mark.trim() || null }, i === div ? `${i} ▼` : String(i)));
    const tip = () => tipRows([
      ["position", String(i)],
      ["original", `${JSON.stringify((a.tokens || [])[i] ?? null)} id ${(a.token_ids || [])[i] ?? "—"}`],
      ["replay", `${JSON.stringify((b.tokens || [])[i] ?? null)} id ${(b.token_ids || [])[i] ?? "—"}`],
      ["logprob", `${fmtLp((a.logprobs || [])[i])} vs ${fmtLp((b.logprobs || [])[i])}`],
      ["|Δ logprob|", i < d.length ? fmtSci(d[i]) : "not compared (after the divergence)"],
    ]);
    const cell = (c, prefix) => el("td", {
      class: `${kind}${mark} has-tip`, id: prefix + i, tip,
    }, i < (c.token_ids || []).length ? tokenLabel((c.tokens || [])[i], c.token_ids[i]) : "");
    rowA.push(cell(a, "a-"));
    rowB.push(cell(b, "b-"));
  }
  return el("div", { class: "align", id: "aligned" }, el("table", null,
    el("thead", null, el("tr", null, head)), el("tbody", null, el("tr", null, rowA), el("tr", null, rowB))));
}

function continuation(c, div, label, id) {
  const tokens = (c.tokens || (c.token_ids || []).map((t) => `#${t} `))
    .map((t) => visible(t ?? ""));
  const from = Math.max(0, div - 8);
  return el("div", { class: "card" }, el("h2", null, label),
    el("div", { class: "cont", id },
      from > 0 ? el("span", { class: "shared" }, "…") : null,
      el("span", { class: "shared" }, tokens.slice(from, div).join("")),
      el("span", { class: "own" }, tokens.slice(div).join("") || "(ends here)")));
}

// |Δ logprob| per position on a log scale: bars where the two sides' logprobs differ, a
// green dot where they are bitwise equal, the first divergence as a dashed line.
function deltaChart(d, n, div) {
  const W = 900, H = 220, L = 64, R = 12, T = 14, B = 34;
  const positive = d.filter((x) => x !== null && x > 0);
  let lo = positive.length ? Math.floor(Math.log10(Math.min(...positive))) : -8;
  let hi = positive.length ? Math.ceil(Math.log10(Math.max(...positive))) : -6;
  if (hi <= lo) hi = lo + 1;
  const width = Math.max(n, 1);
  const x = (i) => L + ((i + 0.5) / width) * (W - L - R);
  const y = (v) => T + (1 - (Math.log10(v) - lo) / (hi - lo)) * (H - T - B - 28);
  const zeroY = H - B - 4;
  const bw = Math.max(1.5, Math.min(14, ((W - L - R) / width) * 0.7));
  const parts = [];
  for (let e = lo; e <= hi; e++) {
    parts.push(svg("line", { class: "grid", x1: L, x2: W - R, y1: y(10 ** e), y2: y(10 ** e) }),
               svg("text", { x: L - 6, y: y(10 ** e) + 4, "text-anchor": "end" }, `1e${e}`));
  }
  parts.push(svg("text", { x: L - 6, y: zeroY + 4, "text-anchor": "end" }, "0"));
  if (div !== null) {
    const xd = x(div) - (W - L - R) / width / 2;
    parts.push(svg("rect", { class: "beyond", x: xd, y: T, width: Math.max(0, W - R - xd), height: H - T - B }),
               svg("line", { class: "divline", x1: xd, x2: xd, y1: T, y2: H - B }),
               svg("text", { class: "divlabel", x: xd + 4, y: T + 12 }, `first divergence: token ${div}`));
  }
  d.forEach((v, i) => {
    if (v === null) return;
    if (v === 0) {
      parts.push(svg("circle", { class: "zero", cx: x(i), cy: zeroY, r: Math.min(3, bw / 2 + 0.5) },
                     svg("title", null, `position ${i}: bitwise equal`)));
    } else {
      const top = y(v);
      parts.push(svg("rect", { class: "bar", x: x(i) - bw / 2, y: top, width: bw,
                               height: Math.max(1, zeroY - top) },
                     svg("title", null, `position ${i}: |Δ| = ${fmtSci(v)}`)));
    }
  });
  parts.push(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }),
             svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  const step = Math.max(1, Math.ceil(width / 16));
  for (let i = 0; i < width; i += step) {
    parts.push(svg("text", { x: x(i), y: H - B + 14, "text-anchor": "middle" }, String(i)));
  }
  parts.push(svg("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, "token position"));
  return el("div", { class: "card chart", id: "delta-chart" },
    el("h2", null, "|Δ logprob| per position"),
    svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img",
                 "aria-label": "absolute logprob difference per token position" }, parts),
    el("div", { class: "legend" },
      el("span", null, el("span", { class: "swatch zero" }), "bitwise equal"),
      el("span", null, el("span", { class: "swatch bar" }), "|Δ| > 0 (log scale)"),
      el("span", null, el("span", { class: "swatch div" }), "first divergence: tokens differ from here")));
}

function verdict(cmp) {
  if (cmp.match) {
    return el("div", { class: "verdict match", id: "verdict" }, "exact match",
      el("span", { class: "detail" },
        `${cmp.tokens_compared} tokens: same ids, every logprob bitwise equal`));
  }
  const detail = cmp.first_divergence !== null
    ? `first divergence at token ${cmp.first_divergence}; max |Δ logprob| before it ${fmtSci(cmp.max_abs_logprob_diff)}`
    : `same tokens, logprobs differ: max |Δ logprob| ${fmtSci(cmp.max_abs_logprob_diff)}`;
  return el("div", { class: "verdict diverged", id: "verdict" }, "diverged",
            el("span", { class: "detail" }, detail));
}

async function viewComparison(id, replayId, params) {
  const record = await api("GET", "/v1/requests/" + encodeURIComponent(id));
  const cmp = (record.replays || []).find((r) => r.replay_id === replayId);
  if (!cmp) throw new ApiError(404, `record '${id}' has no replay '${replayId}'`, "not_found");
  const sameFp = cmp.original_fingerprint === cmp.replay_fingerprint;
  const nodes = [
    el("p", null, el("a", { href: "#/records/" + encodeURIComponent(id) }, "← record " + id)),
    el("h1", null, "Comparison ", el("span", { class: "mono" }, id), " vs ",
       el("span", { class: "mono", id: "replay-id" }, cmp.replay_id)),
    verdict(cmp),
    el("div", { class: "card" }, el("dl", { class: "facts", id: "summary" },
      el("dt", null, "tokens compared"), el("dd", null, cmp.tokens_compared),
      el("dt", null, "first divergence"), el("dd", { id: "first-divergence-value" },
                                             cmp.first_divergence ?? "none"),
      el("dt", null, "token agreement"), el("dd", null, fmtSci(cmp.token_agreement)),
      el("dt", null, "logprob MSE"), el("dd", { id: "mse" }, fmtSci(cmp.logprob_mse)),
      el("dt", null, "max |Δ logprob|"), el("dd", { id: "max-delta" }, fmtSci(cmp.max_abs_logprob_diff)),
      el("dt", null, "load"), el("dd", { id: "load" }, `${cmp.load} other requests at the same time`),
      el("dt", null, "worker"), el("dd", { class: "mono" }, cmp.worker),
      el("dt", null, "original fingerprint"), el("dd", { class: "mono" }, cmp.original_fingerprint),
      el("dt", null, "replay fingerprint"), el("dd", { class: "mono" }, cmp.replay_fingerprint,
        " ", sameFp ? badge("match", "same") : badge("diverged", "different")),
      el("dt", null, "original machine"), el("dd", null, fmtMachine(cmp.original_machine)),
      el("dt", null, "replay machine"), el("dd", { id: "replay-machine" },
                                            fmtMachine(cmp.replay_machine)),
      el("dt", null, "replayed"), el("dd", null, fmtTime(cmp.created)))),
  ];
  const replayChoices = cmp.replay_choices;
  if (!Array.isArray(replayChoices)) {
    nodes.push(el("p", { class: "card muted" }, "This replay was stored without its tokens."));
  } else {
    const index = Number(params.get("choice") || 0);
    const a = (record.choices || []).find((c) => c.index === index) || { token_ids: [], logprobs: [] };
    const b = replayChoices.find((c) => c.index === index) || { token_ids: [], logprobs: [] };
    if ((record.choices || []).length > 1) {
      nodes.push(el("p", null, "choice: ", record.choices.map((c) => [el("a", {
        href: `#/records/${encodeURIComponent(id)}/replays/${encodeURIComponent(replayId)}?choice=${c.index}`,
      }, String(c.index)), " "])));
    }
    const div = firstDivergence(a, b);
    const n = Math.max((a.token_ids || []).length, (b.token_ids || []).length);
    const d = deltas(a, b, div === null ? n : div);
    nodes.push(el("h2", null, "Tokens, aligned"), alignTable(a, b, div, d));
    if (div !== null) {
      nodes.push(el("h2", null, `From token ${div} on`), el("div", { class: "grid2", id: "continuations" },
        continuation(a, div, "original", "cont-original"),
        continuation(b, div, "replay", "cont-replay")));
    } else {
      nodes.push(el("p", { class: "muted", id: "no-token-divergence" },
        "No token divergence: both sides chose the same token at every position."));
    }
    nodes.push(deltaChart(d, n, div));
  }
  nodes.push(el("div", { class: "card" }, el("h2", null, "Replay again"), replayNow(record)));
  show(...nodes);
  const mark = document.querySelector("#aligned td.first-divergence");
  if (mark) mark.scrollIntoView({ block: "nearest", inline: "center" });
}

// ---- routing ---------------------------------------------------------------------------

async function render() {
  const forget = document.getElementById("forget-key");
  forget.hidden = !sessionStorage.getItem(KEY_SLOT);
  const hash = location.hash || "#/";
  const [path, query] = hash.slice(1).split("?");
  const params = new URLSearchParams(query || "");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  let what = "Page";
  try {
    if (parts.length === 0) {
      what = "Records";
      await viewList(params);
    } else if (parts[0] === "drift" && parts.length === 1) {
      what = "Drift report";
      await viewDrift();
    } else if (parts[0] === "records" && parts.length === 2) {
      what = "Record";
      await viewRecord(parts[1]);
    } else if (parts[0] === "records" && parts.length === 4 && parts[2] === "replays") {
      what = "Record";
      await viewComparison(parts[1], parts[3], params);
    } else {
      throw new ApiError(404, "no such page", "not_found");
    }
  } catch (err) {
    failure(err, what);
  }
  forget.hidden = !sessionStorage.getItem(KEY_SLOT);
}

document.getElementById("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_SLOT);
  render();
});
window.addEventListener("hashchange", render);
render();
