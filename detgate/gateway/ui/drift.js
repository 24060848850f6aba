// The drift page (#/drift): the caller's last drift report (GET /v1/drift), made by
// `detgate drift` or POST /v1/drift. Uses app.js's helpers (el, api, show, badge, fmtSci);
// loaded before it, called only once app.js has run. Same rule as there: report strings
// reach the page as text only.
"use strict";

function driftShare(g) {
  if (g.identical_share === null) return "—";
  return `${(100 * g.identical_share).toFixed(1)}% (${g.identical}/${g.replayed})`;
}

function driftPositions(g) {
  const p = [...g.first_divergence].sort((a, b) => a - b);
  if (!p.length) return "—";
  return `${p.length}: min ${p[0]}, median ${p[Math.floor(p.length / 2)]}, max ${p[p.length - 1]}`;
}

function driftGroups(report) {
  return [["all", report.summary],
    ...Object.entries(report.by_endpoint).map(([k, g]) => ["endpoint " + k, g]),
    ...Object.entries(report.by_tenant).map(([k, g]) => ["tenant " + k, g])];
}

async function viewDrift() {
  let report;
  try {
    report = await api("GET", "/v1/drift");
  } catch (err) {
    if (!(err instanceof ApiError) || err.status !== 404) throw err;
    show(el("h1", null, "Drift"),
      el("p", { class: "card muted", id: "no-drift" }, "No drift report yet. Make one with " +
        "`detgate drift --base-url … --from FINGERPRINT --to FINGERPRINT` (or POST /v1/drift)."));
    return;
  }
  const s = report.summary;
  const verdict = s.identical_share === null ? badge("none", "nothing replayed")
    : s.identical_share === 1 ? badge("match", "every record reproduces")
      : badge("diverged", `${s.replayed - s.identical} of ${s.replayed} records drift`);
  const groups = el("table", { id: "drift-groups" },
    el("thead", null, el("tr", null,
      ["Group", "Records", "Identical", "Errors", "First divergences", "Logprob MSE (mean)",
        "Max |Δ logprob|"].map((t) => el("th", null, t)))),
    el("tbody", null, driftGroups(report).map(([name, g]) => el("tr", { class: "drift-group" },
      el("td", null, name), el("td", { class: "num" }, g.records),
      el("td", { class: "num share" }, driftShare(g)), el("td", { class: "num" }, g.errors),
      el("td", null, driftPositions(g)), el("td", { class: "num" }, fmtSci(g.logprob_mse_mean)),
      el("td", { class: "num" }, fmtSci(g.max_abs_logprob_diff))))));
  const diverged = report.records.filter((r) => r.error === null && !r.match);
  const failed = report.records.filter((r) => r.error !== null);
  const rows = [...diverged, ...failed].slice(0, 200).map((r) => el("tr", { class: "drift-row" },
    el("td", { class: "mono" }, el("a", { href: "#/records/" + encodeURIComponent(r.id) }, r.id)),
    el("td", { class: "mono" }, r.endpoint === "/v1/chat/completions" ? "chat" : "completions"),
    el("td", null, r.error === null ? badge("diverged") : badge("failed", r.error)),
    el("td", { class: "num" }, r.first_divergence === null ? "—" : r.first_divergence),
    el("td", { class: "num" }, fmtSci(r.logprob_mse))));
  const nodes = [
    el("h1", null, "Drift"),
    el("div", { class: "card", id: "drift-summary" },
      el("p", null, verdict, " records of ", el("span", { class: "mono" }, report.from_fingerprint),
        " replayed on ", el("span", { class: "mono" }, report.to_fingerprint)),
      el("p", { class: "muted" }, `${report.selected} of ${report.matched} records found ` +
        `(${report.examined} examined), ${fmtTime(report.created)}, ${report.duration_s} s`)),
    groups];
  if (rows.length) {
    nodes.push(el("div", { class: "card" }, el("h2", null, "Records that did not reproduce"),
      el("table", { id: "drift-records" }, el("thead", null, el("tr", null,
        ["Record", "Endpoint", "Result", "First divergence", "Logprob MSE"].map(
          (t) => el("th", null, t)))), el("tbody", null, rows))));
  }
  show(...nodes);
}
