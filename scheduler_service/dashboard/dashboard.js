// Flywheel's live dashboard: polls GET v1/dashboard/data every POLL_MS and redraws every chart with
// Plotly.react (which diffs, so a redraw keeps zoom and costs little). The timeline shows one group's trace
// from GET v1/dashboard/trace/<group id>: the group named by ?group= in the page's URL, the one picked in
// the selector, or by default the newest group whose trace reached the most services.
"use strict";

const POLL_MS = 3000;
const PLOT_CONFIG = { displayModeBar: false, responsive: true };
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf"];
const SERVICE_COLORS = { scheduler: "#1f77b4", rollout: "#ff7f0e", verifier: "#2ca02c", sandbox: "#d62728",
                         trainer: "#9467bd" };
const PURPOSE_COLORS = { train: "#4c78a8", eval: "#9ecae9" };

let pickedGroup = new URLSearchParams(location.search).get("group");  // null: follow the default

// ------------------------------------------------------------------ helpers

function $(id) { return document.getElementById(id); }

function fmt(x, digits = 3) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return x.toLocaleString();
  return Math.abs(x) >= 100 ? x.toFixed(0) : x.toPrecision(digits);
}

function clock(unixS) { return unixS ? new Date(unixS * 1000).toLocaleTimeString() : "–"; }

function colorOf(domain, domains) { return PALETTE[domains.indexOf(domain) % PALETTE.length]; }

function layout(xTitle, yTitle, extra = {}) {
  return Object.assign({
    margin: { l: 48, r: 10, t: 26, b: 40 }, showlegend: true,
    legend: { orientation: "h", x: 0, y: 1.02, xanchor: "left", yanchor: "bottom", font: { size: 11 } },
    xaxis: { title: { text: xTitle, font: { size: 11 } }, automargin: true },
    yaxis: { title: { text: yTitle, font: { size: 11 } }, automargin: true, rangemode: "tozero" },
    font: { size: 11 }, paper_bgcolor: "#fff", plot_bgcolor: "#fff", uirevision: "keep",
  }, extra);
}

function draw(id, traces, lay) { Plotly.react($(id), traces, lay, PLOT_CONFIG); }

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function pill(row, text) {
  const td = row.insertCell();
  const span = document.createElement("span");
  span.className = `pill ${text}`;
  span.textContent = text;
  td.appendChild(span);
}

function fillTable(id, rows, columns, addRow) {
  const body = $(id).tBodies[0];
  body.replaceChildren();
  if (!rows.length) {
    const td = cell(body.insertRow(), "none", "empty");
    td.colSpan = columns;
  }
  for (const r of rows) addRow(body.insertRow(), r);
}

// ------------------------------------------------------------------ header

function renderStatus(d) {
  const s = d.status;
  $("st-version").textContent = fmt(s.policy_version);
  $("st-step").textContent = fmt(s.trainer_step);
  const paused = s.training_paused;
  $("st-training").textContent = paused ? `paused (${paused.reason || paused.by || "operator"})` : "running";
  $("st-training").className = paused ? "paused" : "";
  $("st-samples").textContent = fmt(s.samples_scored);
  $("st-inflight").textContent = fmt(s.in_flight_groups);
  $("st-throughput").textContent = fmt(s.throughput_samples_per_s);
  $("st-alerts").textContent = fmt(d.alerts.active.length);
  $("live").textContent = `live · updated ${clock(d.time)} · built in ${fmt(d.build_ms, 2)} ms`;
  $("live").className = "ok";
}

// ------------------------------------------------------------------ charts

function curveTraces(curves, key, domains) {
  return domains.map((dom) => ({
    type: "scatter", mode: "lines+markers", name: dom, line: { color: colorOf(dom, domains) },
    marker: { size: 5 },
    x: curves[dom].filter((p) => p[key] !== null).map((p) => p.policy_version),
    y: curves[dom].filter((p) => p[key] !== null).map((p) => p[key]),
    hovertemplate: `${dom}: %{y:.3f} at version %{x}<extra></extra>`,
  }));
}

function renderCurves(d, domains) {
  const c = d.curves;
  draw("chart-reward", curveTraces(c, "reward_mean", domains), layout("policy version", "reward"));
  draw("chart-pass", curveTraces(c, "pass_rate", domains),
       layout("policy version", "pass rate", { yaxis: { range: [-0.04, 1.05], title: { text: "pass rate" } } }));
  draw("chart-length", curveTraces(c, "length_mean", domains), layout("policy version", "tokens"));
  draw("chart-diversity", curveTraces(c, "diversity", domains),
       layout("policy version", "distinct / K", { yaxis: { range: [-0.04, 1.05], title: { text: "distinct / K" } } }));
}

function renderEvals(d, domains) {
  const ev = d.evals.filter((e) => e.accuracy !== null);
  const traces = [{
    type: "scatter", mode: "lines+markers", name: "all domains", line: { color: "#1d2330", width: 3 },
    x: ev.map((e) => e.policy_version), y: ev.map((e) => e.accuracy),
    text: ev.map((e) => `round ${e.eval_round}, ${e.completed}/${e.n} items${e.done ? "" : " (running)"}`),
    hovertemplate: "%{y:.3f} at version %{x}<br>%{text}<extra></extra>",
  }];
  const evDomains = [...new Set(ev.flatMap((e) => Object.keys(e.domains)))].sort();
  for (const dom of evDomains) {
    const pts = ev.filter((e) => e.domains[dom] && e.domains[dom].accuracy !== null);
    traces.push({
      type: "scatter", mode: "lines+markers", name: dom, line: { dash: "dot", color: colorOf(dom, domains) },
      x: pts.map((e) => e.policy_version), y: pts.map((e) => e.domains[dom].accuracy),
      hovertemplate: `${dom}: %{y:.3f} at version %{x}<extra></extra>`,
    });
  }
  draw("chart-eval", traces,
       layout("policy version", "accuracy", { yaxis: { range: [-0.04, 1.05], title: { text: "accuracy" } } }));
}

function renderStaleness(d) {
  const s = d.staleness;
  draw("chart-staleness", [{
    type: "bar", name: `samples (${s.steps} steps)`, x: s.versions_behind, y: s.samples,
    marker: { color: "#4c78a8" }, hovertemplate: "%{y} samples %{x} versions behind<extra></extra>",
  }], layout("versions behind", "samples", { xaxis: { dtick: 1, title: { text: "versions behind" } } }));
}

function renderThroughput(d) {
  const sc = d.throughput.scored, tr = d.throughput.trained;
  const when = (rows) => rows.map((r) => new Date(r.t * 1000));
  draw("chart-throughput", [
    { type: "scatter", mode: "lines", name: "scored samples/s", x: when(sc), y: sc.map((r) => r.samples_per_s),
      line: { shape: "hv", color: "#1f77b4" } },
    { type: "scatter", mode: "lines", name: "completed groups/s", x: when(sc), y: sc.map((r) => r.groups_per_s),
      line: { shape: "hv", color: "#ff7f0e" } },
    { type: "scatter", mode: "markers", name: "trained samples/s", x: when(tr), y: tr.map((r) => r.samples_per_s),
      marker: { color: "#2ca02c", size: 6 }, text: tr.map((r) => `step ${r.step}`),
      hovertemplate: "%{y:.2f} samples/s, %{text}<extra></extra>" },
  ], layout("", "per second", { xaxis: { type: "date", automargin: true } }));
}

function renderSpend(d, domains) {
  const purposes = [...new Set(d.spend.map((r) => r.purpose))].sort();
  const traces = purposes.map((p) => {
    const rows = d.spend.filter((r) => r.purpose === p);
    return { type: "bar", name: p, x: rows.map((r) => r.domain), y: rows.map((r) => r.generated_tokens),
             marker: { color: PURPOSE_COLORS[p] || "#bab0ac" },
             hovertemplate: `${p}: %{y} tokens in %{x}<extra></extra>` };
  });
  draw("chart-spend", traces, layout("domain", "generated tokens", { barmode: "stack" }));
  fillTable("spend-table", d.spend, 8, (row, r) => {
    cell(row, r.domain); cell(row, r.purpose); cell(row, fmt(r.samples)); cell(row, fmt(r.generated_tokens));
    cell(row, fmt((r.sandbox_seconds || 0) + (r.tool_seconds || 0))); cell(row, fmt(r.judge_calls));
    cell(row, fmt(r.verify_seconds));
    const caps = Object.entries(r.budget || {}).map(([k, b]) => `${k} ${fmt(b.spent)} / ${fmt(b.cap)}`);
    cell(row, caps.length ? caps.join(", ") : (r.purpose === "train" ? "no cap" : ""));
  });
}

// ------------------------------------------------------------------ tables

function renderAlerts(d) {
  const active = new Set(d.alerts.active.map((a) => `${a.key}@${a.time}`));
  const rows = [...d.alerts.active.map((a) => [true, a]),
                ...d.alerts.recent.filter((a) => !active.has(`${a.key}@${a.time}`)).map((a) => [false, a])];
  fillTable("alerts-table", rows, 8, (row, [isActive, a]) => {
    if (isActive) row.className = "active";
    cell(row, clock(a.time)); cell(row, a.key); pill(row, a.severity);
    pill(row, isActive ? "firing" : a.status);
    cell(row, fmt(a.value)); cell(row, fmt(a.threshold)); cell(row, fmt(a.policy_version));
    cell(row, a.message, "msg");
  });
}

function renderBreakers(d) {
  fillTable("breakers-table", d.breakers, 6, (row, b) => {
    cell(row, b.domain); pill(row, b.state); cell(row, b.since ? clock(b.since) : "–");
    cell(row, b.signal || "–"); cell(row, fmt(b.trips));
    cell(row, b.pause_reason ? `paused: ${b.pause_reason}` : (b.domain_state || "–"));
  });
}

// ------------------------------------------------------------------ the group timeline

function defaultGroup(groups) {
  let best = null;
  for (const g of groups) {  // newest first: keep the first with the most services
    const n = (g.services || []).length;
    if (best === null || n > (best.services || []).length) best = g;
  }
  return best ? best.group_id : null;
}

function renderGroupPicker(d) {
  const sel = $("trace-group");
  const groups = d.traces.groups;
  const wanted = pickedGroup || defaultGroup(groups);
  const ids = groups.map((g) => g.group_id);
  if (wanted && !ids.includes(wanted)) ids.unshift(wanted);
  const options = ids.map((id) => {
    const g = groups.find((x) => x.group_id === id);
    const label = g ? `${g.domain || "?"} · ${id}${g.services ? ` (${g.services.length} services)` : ""}` : id;
    return new Option(label, id, false, id === wanted);
  });
  const signature = options.map((o) => `${o.value}|${o.text}|${o.selected}`).join("\n");
  if (sel.dataset.signature !== signature) {  // rebuilt only when it changed: an open list stays open
    sel.replaceChildren(...options);
    sel.dataset.signature = signature;
  }
  return wanted;
}

async function renderTrace(groupId) {
  if (!groupId) {
    draw("chart-trace", [], layout("ms since the group was issued", "", {
      annotations: [{ text: "no trace yet (is telemetry.traces off?)", showarrow: false, xref: "paper",
                      yref: "paper", x: 0.5, y: 0.5 }] }));
    return;
  }
  const t = await getJSON(`v1/dashboard/trace/${encodeURIComponent(groupId)}`);
  const seen = {};
  const label = (sp) => {  // one row per span, in start order
    const base = `${sp.service} · ${sp.name}`;
    seen[base] = (seen[base] || 0) + 1;
    return seen[base] > 1 ? `${base} #${seen[base]}` : base;
  };
  const rows = t.spans.map((sp) => ({ ...sp, row: label(sp) }));
  const traces = t.services.map((svc) => {
    const mine = rows.filter((r) => r.service === svc);
    return { type: "bar", orientation: "h", name: svc, y: mine.map((r) => r.row),
             x: mine.map((r) => Math.max(r.duration_ms, 0.05)), base: mine.map((r) => r.start_ms),
             marker: { color: SERVICE_COLORS[svc] || "#7f7f7f" },
             text: mine.map((r) => `${r.name}: starts ${fmt(r.start_ms)} ms, lasts ${fmt(r.duration_ms)} ms` +
                                   (r.status && r.status !== "OK" && r.status !== "UNSET" ? ` (${r.status})` : "")),
             hovertemplate: "%{text}<extra>%{fullData.name}</extra>", textposition: "none" };
  });
  draw("chart-trace", traces, layout("ms since the group was issued", "", {
    barmode: "overlay", legend: { orientation: "v", x: 1.01, y: 1, yanchor: "top" },
    margin: { l: 10, r: 10, t: 8, b: 40 },
    yaxis: { automargin: true, autorange: "reversed", type: "category", categoryorder: "array",
             categoryarray: rows.map((r) => r.row) },
  }));
}

// ------------------------------------------------------------------ the loop

function render(d) {
  const domains = Object.keys(d.curves).sort();
  renderStatus(d);
  renderCurves(d, domains);
  renderEvals(d, domains);
  renderStaleness(d);
  renderThroughput(d);
  renderSpend(d, domains);
  renderAlerts(d);
  renderBreakers(d);
  return renderTrace(renderGroupPicker(d));
}

async function poll() {
  try {
    await render(await getJSON("v1/dashboard/data"));
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  } catch (e) {
    $("live").textContent = `not updating: ${e.message}`;
    $("live").className = "stale";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

$("trace-group").addEventListener("change", (e) => {
  pickedGroup = e.target.value;
  renderTrace(pickedGroup).catch((err) => console.error(err));
});

poll();
