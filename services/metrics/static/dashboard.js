// prefixmesh live dashboard: polls the metrics service's /cluster JSON and redraws.
// Plain DOM and SVG, no dependencies or build step. Thresholds below mark a cell red;
// docs/operations.md explains what to do about each.
"use strict";

const REFRESH_MS = 1000;
const KV_USAGE_BAD = 0.95;       // a worker this full evicts before it can reuse
const WAITING_BAD = 32;          // requests queued on one worker
const KV_LAG_BAD_S = 1.0;        // KV events this old when the scheduler gets them
const CHART_W = 600, CHART_H = 200, PAD = 28;

const $ = (id) => document.getElementById(id);
const pct = (x) => (100 * x).toFixed(1) + "%";
const secs = (x) => x >= 1 ? x.toFixed(2) + " s" : (1000 * x).toFixed(0) + " ms";
let lastGaps = null;

function cell(tr, text, cls) {
  const td = document.createElement("td");
  if (text instanceof Node) td.appendChild(text); else td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}

function bar(ratio, bad) {
  const span = document.createElement("span");
  const wrap = document.createElement("span");
  wrap.className = "bar" + (bad ? " bad" : "");
  const fill = document.createElement("i");
  fill.style.width = Math.min(100, Math.max(0, 100 * ratio)).toFixed(1) + "%";
  wrap.appendChild(fill);
  span.appendChild(wrap);
  span.appendChild(document.createTextNode(pct(ratio)));
  return span;
}

function renderWorkers(workers) {
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of workers) {
    const tr = document.createElement("tr");
    tr.dataset.worker = w.worker_id;
    cell(tr, w.worker_id);
    cell(tr, w.backend + (w.model ? " · " + w.model : ""));
    cell(tr, String(w.running), "running");
    cell(tr, String(w.waiting), w.waiting >= WAITING_BAD ? "waiting bad" : "waiting");
    cell(tr, bar(w.kv_usage, w.kv_usage >= KV_USAGE_BAD), "kv");
    cell(tr, pct(w.hit_ratio), "hit");
    cell(tr, pct(w.decode_share), "decode");
    cell(tr, secs(w.avg_step_s), "step");
    cell(tr, secs(w.avg_queue_s), "queue");
    cell(tr, String(w.completed), "completed");
    cell(tr, w.stale ? "stale" : "live", w.stale ? "state bad" : "state ok");
    body.appendChild(tr);
  }
}

function renderScheduler(s) {
  const box = $("decisions");
  box.replaceChildren();
  const stats = $("scheduler-stats");
  stats.replaceChildren();
  if (!s) { $("scheduler-info").textContent = "(no scheduler summary yet)"; return; }
  $("scheduler-info").textContent =
    `(${s.policy}, instance ${s.id}${s.stale ? ", STALE" : ""})`;
  for (const [kind, n] of Object.entries(s.decisions)) {
    const row = document.createElement("div");
    row.className = "decision";
    row.dataset.kind = kind;
    const name = document.createElement("span"); name.textContent = kind;
    const count = document.createElement("span"); count.textContent = String(n);
    count.style.textAlign = "right";
    row.append(name, bar(s.decision_share[kind] || 0, kind === "none"), count);
    box.appendChild(row);
  }
  const gapsGrew = lastGaps !== null && s.kv_gaps > lastGaps;
  lastGaps = s.kv_gaps;
  const items = [
    ["prefix tree", `${s.tree_nodes} nodes, ${s.tree_tokens} tokens`],
    ["routable workers", String(s.workers)],
    ["KV event lag", secs(s.kv_lag_s), s.kv_lag_s >= KV_LAG_BAD_S],
    ["KV event gaps", String(s.kv_gaps), gapsGrew],
    ["replicas added / dropped", `${s.replicas_added} / ${s.replicas_dropped}`],
  ];
  for (const [k, v, bad] of items) {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = v;
    if (bad) dd.className = "bad";
    stats.append(dt, dd);
  }
  const body = $("prefixes").tBodies[0];
  body.replaceChildren();
  for (const h of s.hot_prefixes) {
    const tr = document.createElement("tr");
    tr.dataset.prefix = h.prefix_id;
    const code = document.createElement("code"); code.textContent = h.prefix_id.slice(0, 12);
    cell(tr, code);
    cell(tr, String(h.tokens));
    cell(tr, String(h.requests));
    cell(tr, h.workers.length ? h.workers.join(", ") : "-", "cached-on");
    body.appendChild(tr);
  }
}

function line(points, maxY, color) {
  const n = points.length;
  if (n < 2) return "";
  const xs = (i) => PAD + (CHART_W - PAD - 4) * i / (n - 1);
  const ys = (v) => CHART_H - PAD + (-(CHART_H - PAD - 8) * v / maxY);
  const d = points.map((v, i) => `${xs(i).toFixed(1)},${ys(v).toFixed(1)}`).join(" ");
  return `<polyline fill="none" stroke="${color}" stroke-width="1.8" points="${d}"/>`;
}

function chart(svg, series, fmt) {
  let maxY = 0;
  for (const s of series) for (const v of s.values) maxY = Math.max(maxY, v);
  maxY = maxY > 0 ? maxY * 1.1 : 1;
  const style = getComputedStyle(document.documentElement);
  let html = `<line x1="${PAD}" y1="${CHART_H - PAD}" x2="${CHART_W}" y2="${CHART_H - PAD}" stroke="#2d3a46"/>`;
  html += `<text x="2" y="12">${fmt(maxY)}</text><text x="2" y="${CHART_H - PAD}">0</text>`;
  for (const s of series) html += line(s.values, maxY, style.getPropertyValue(s.color).trim());
  svg.innerHTML = html;
  svg.dataset.points = String(series[0].values.length);
}

function renderHistory(history) {
  chart($("latency-chart"), [
    { values: history.map((p) => p.latency_p50_s), color: "--a" },
    { values: history.map((p) => p.latency_p99_s), color: "--b" },
    { values: history.map((p) => p.ttft_p99_s), color: "--c" },
  ], (v) => v.toFixed(2) + "s");
  chart($("load-chart"), [
    { values: history.map((p) => p.throughput_rps), color: "--a" },
    { values: history.map((p) => p.waiting), color: "--b" },
  ], (v) => v.toFixed(1));
}

function renderBatches(batches) {
  $("batches-row").hidden = batches.length === 0;
  const body = $("batches").tBodies[0];
  body.replaceChildren();
  for (const b of batches) {
    const tr = document.createElement("tr");
    cell(tr, b.id); cell(tr, b.status); cell(tr, String(b.completed));
    cell(tr, String(b.failed), b.failed ? "bad" : ""); cell(tr, String(b.total));
    body.appendChild(tr);
  }
}

function render(view) {
  const live = view.workers.filter((w) => !w.stale);
  const last = view.history.length ? view.history[view.history.length - 1] : null;
  $("workers-live").textContent = `${live.length} / ${view.workers.length}`;
  $("workers-live").className = "value" + (live.length < view.workers.length ? " bad" : "");
  $("completed-total").textContent = String(view.completed_total);
  $("throughput").textContent = last ? last.throughput_rps.toFixed(2) : "-";
  $("latency").textContent = `${secs(view.recent.latency_p50_s)} / ${secs(view.recent.latency_p99_s)}`;
  $("ttft").textContent = `${secs(view.recent.ttft_p50_s)} / ${secs(view.recent.ttft_p99_s)}`;
  $("hit-ratio").textContent = pct(view.recent.cache_hit_ratio);
  $("queue").textContent = last ? `${last.running} / ${last.waiting}` : "-";
  renderWorkers(view.workers);
  renderScheduler(view.scheduler);
  renderHistory(view.history);
  renderBatches(view.batches);
}

async function refresh() {
  const status = $("status");
  try {
    const resp = await fetch("cluster", { cache: "no-store" });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    render(await resp.json());
    status.textContent = "updated " + new Date().toLocaleTimeString();
    status.className = "status";
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (err) {
    status.textContent = "cannot reach the metrics service: " + err.message;
    status.className = "status bad";
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
