// Treadle's live page: reads /dashboard/feed (server-sent events, one snapshot a second) with
// fetch, so that the API key goes as an Authorization header (EventSource cannot send one), and
// draws the four panels. No library, no build step.
"use strict";

const KEY_STORAGE = "treadle-api-key";
const STEP_KEEP = 2000;       // steps kept for the chart
const GANTT_ROWS = 40;
const GANTT_MAX_SECONDS = 60;
const $ = (id) => document.getElementById(id);

let steps = [];               // [clientTime, duration, requests, prefill, decode, preemptions]
let lastData = null;
let selected = null;          // the request id whose detail is open

// The key: ?key=... once (then dropped from the address bar), kept for this tab only.
(function takeKeyFromUrl() {
  const url = new URL(location.href);
  const key = url.searchParams.get("key");
  if (key !== null) {
    sessionStorage.setItem(KEY_STORAGE, key);
    url.searchParams.delete("key");
    history.replaceState(null, "", url.pathname + url.search + url.hash);
  }
})();

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function setStatus(text, kind) {
  const pill = $("status");
  pill.textContent = text;
  pill.className = "pill " + (kind || "");
}

function askForKey() {
  setStatus("API key needed", "bad");
  $("key-form").hidden = false;
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("key-input").value);
  $("key-form").hidden = true;
  connect();
});

// The feed: one `data: {json}` event a second; reconnects after a pause when it ends.
async function connect() {
  setStatus("connecting");
  let response;
  try {
    response = await fetch("/dashboard/feed", { headers: authHeaders(), cache: "no-store" });
  } catch (error) {
    return retry("server unreachable");
  }
  if (response.status === 401) return askForKey();
  if (!response.ok) return retry(`feed: HTTP ${response.status}`);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data: "))
          .map((l) => l.slice(6)).join("\n");
        if (data) update(JSON.parse(data));
      }
    }
  } catch (error) {
    return retry("feed interrupted");
  }
  retry("feed ended");
}

function retry(why) {
  setStatus(why + ", retrying", "bad");
  setTimeout(connect, 2000);
}

function update(data) {
  const now = performance.now() / 1000;
  lastData = data;
  for (const s of data.steps) steps.push([now + s[0], s[1], s[2], s[3], s[4], s[5]]);
  if (steps.length > STEP_KEEP) steps = steps.slice(steps.length - STEP_KEEP);
  const engine = data.engine;
  $("model").textContent = `${engine.model} · ${engine.num_blocks} blocks · context ${engine.max_model_len}`;
  setStatus(`engine ${engine.status}`, engine.status === "ok" ? "ok" : "bad");
  $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  drawNow(data.now, data.rejections);
  drawAdapters(data.now, engine.max_loras);
  drawLatency(data.latency, engine.objectives);
  drawSteps(now);
  drawGantt(data.requests);
}

const fmtInt = (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString());
const fmtPct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
function fmtSec(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms";
  return s.toFixed(2) + " s";
}

function drawNow(now, rejections) {
  $("running").textContent = fmtInt(now.running);
  $("waiting").textContent = fmtInt(now.waiting);
  $("step-rate").textContent = now.steps_per_s.toFixed(1);
  $("token-rate").textContent = `${fmtInt(now.prefill_tokens_per_s)} prefill · ${fmtInt(now.decode_tokens_per_s)} decode tok/s`;
  $("prefix-hits").textContent = fmtPct(now.prefix_hit_rate.minute);
  $("prefix-total").textContent = "since start " + fmtPct(now.prefix_hit_rate.total);
  $("rejections").textContent = fmtInt(rejections.minute);
  const reasons = Object.entries(rejections.by_reason).map(([r, n]) => `${r} ${n}`).join(", ");
  $("rejections-total").textContent = `total ${rejections.total}` + (reasons ? ` (${reasons})` : "");
  $("preemptions").textContent = fmtInt(now.preemptions.minute);
  $("preemptions-total").textContent = "total " + fmtInt(now.preemptions.total);
  const kv = now.kv_blocks;
  const share = (n) => (kv.total ? (100 * n) / kv.total : 0) + "%";
  $("kv-used").style.width = share(kv.used);
  $("kv-cached").style.width = share(kv.cached_free);
  $("kv-free").style.width = share(kv.free);
  $("kv-text").textContent = `${kv.used} in use · ${kv.cached_free} cached · ${kv.free} free of ${kv.total}`;
  const classes = new Map();
  for (const [list, field] of [[now.waiting_by, "waiting"], [now.running_by, "running"]]) {
    for (const c of list) {
      const key = `${c.tenant}\u0000${c.priority}`;
      const row = classes.get(key) || { tenant: c.tenant, priority: c.priority, waiting: 0, running: 0 };
      row[field] += c.requests;
      classes.set(key, row);
    }
  }
  fillTable($("classes"), [...classes.values()].map((row) =>
    [row.tenant, row.priority, row.waiting, row.running]), "no requests in the engine");
  drawTenants(now);
  drawReplicas(now.replicas);
}

// Each tenant's KV blocks held now and share of the tokens scheduled lately; blocks several
// tenants hold (a shared prefix) on a row of their own, so the rows add up to the blocks in use.
function drawTenants(now) {
  $("token-window").textContent = now.token_window_s;
  const rows = now.tenants.map((t) => [t.tenant, fmtInt(t.kv_blocks), fmtPct(t.kv_share),
                                       fmtPct(t.token_share)]);
  if (now.kv_shared && now.kv_shared.kv_blocks) {
    rows.push(["shared by tenants", fmtInt(now.kv_shared.kv_blocks),
               fmtPct(now.kv_shared.kv_share), "–"]);
  }
  fillTable($("tenants"), rows, "no tenant holds blocks or was scheduled lately");
}

// Each LoRA adapter's requests waiting and running now and share of the tokens scheduled
// lately (a tenant's key: its own requests'); hidden when the server serves no adapters.
function drawAdapters(now, maxLoras) {
  const served = maxLoras !== null && maxLoras !== undefined;
  $("adapters-box").hidden = !served;
  if (!served) return;
  $("max-loras").textContent = maxLoras;
  $("adapter-token-window").textContent = now.token_window_s;
  fillTable($("adapters"), now.adapters.map((a) => [a.adapter, fmtInt(a.waiting),
                                                    fmtInt(a.running), fmtPct(a.token_share)]),
            "no adapter's requests in the engine or scheduled lately");
}

// A table body's rows of 4 cells, or one muted row saying why there are none.
function fillTable(body, rows, emptyText) {
  body.replaceChildren();
  for (const cells of rows) {
    const tr = document.createElement("tr");
    for (const v of cells) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    td.className = "muted";
    td.colSpan = 4;
    td.textContent = emptyText;
    tr.appendChild(td);
    body.appendChild(tr);
  }
}

// Data-parallel replicas (--data-parallel-size): one row each; hidden with one engine.
function drawReplicas(replicas) {
  $("replicas-table").hidden = !replicas.length;
  const body = $("replicas");
  body.replaceChildren();
  for (const r of replicas) {
    const tr = document.createElement("tr");
    if (!r.up) tr.className = "down";
    for (const v of [r.replica, r.up ? "up" : "down", r.waiting, r.running, fmtPct(r.kv_usage)]) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

function drawLatency(latency, objectives) {
  const body = $("latency-rows");
  body.replaceChildren();
  const rows = [["TTFT", latency.ttft, objectives.ttft], ["ITL", latency.itl, objectives.tpot],
                ["E2E", latency.e2e, null]];
  for (const [name, stats, objective] of rows) {
    const tr = document.createElement("tr");
    const cells = [name, fmtSec(stats.p50), fmtSec(stats.p90), fmtSec(stats.p99),
                   fmtInt(stats.count), objective === null ? "–" : fmtSec(objective)];
    cells.forEach((text, i) => {
      const td = document.createElement("td");
      td.textContent = text;
      const value = [null, stats.p50, stats.p90, stats.p99][i];
      if (objective !== null && value !== null && value !== undefined) {
        td.className = value > objective ? "over" : "under";
      }
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }
}

// Steps: one bar per step, newest right (prefill stacked on decode tokens), the batch size as
// dots, the step time as a line on the right axis, preemptions as red marks on top.
function drawSteps(now) {
  const canvas = $("step-chart");
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = width * dpr;
  canvas.height = height * dpr;
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  ctx.clearRect(0, 0, width, height);
  const left = 48, right = 56, top = 12, bottom = 20;
  const plotW = width - left - right, plotH = height - top - bottom;
  const barW = 3;
  const shown = steps.slice(-Math.floor(plotW / barW));
  const maxTokens = Math.max(8, ...shown.map((s) => s[3] + s[4]));
  const maxBatch = Math.max(1, ...shown.map((s) => s[2]));
  const maxTime = Math.max(0.001, ...shown.map((s) => s[1]));
  ctx.font = "11px ui-monospace, monospace";
  ctx.fillStyle = "#8891a0";
  ctx.strokeStyle = "#262d38";
  for (const f of [0, 0.5, 1]) {
    const y = top + plotH * (1 - f);
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + plotW, y); ctx.stroke();
    ctx.textAlign = "right";
    ctx.fillText(Math.round(maxTokens * f).toString(), left - 6, y + 4);
    ctx.textAlign = "left";
    ctx.fillText(fmtSec(maxTime * f), left + plotW + 6, y + 4);
  }
  ctx.save();
  ctx.translate(12, top + plotH / 2); ctx.rotate(-Math.PI / 2);
  ctx.textAlign = "center"; ctx.fillText("tokens", 0, 0);
  ctx.restore();
  if (!shown.length) {
    ctx.textAlign = "center";
    ctx.fillText("no steps yet", left + plotW / 2, top + plotH / 2);
    return;
  }
  const x0 = left + plotW - shown.length * barW;
  shown.forEach((s, i) => {
    const x = x0 + i * barW;
    const decodeH = (s[4] / maxTokens) * plotH, prefillH = (s[3] / maxTokens) * plotH;
    ctx.fillStyle = "#4ea1ff";
    ctx.fillRect(x, top + plotH - decodeH, barW - 1, decodeH);
    ctx.fillStyle = "#f0a35e";
    ctx.fillRect(x, top + plotH - decodeH - prefillH, barW - 1, prefillH);
    if (s[5] > 0) {
      ctx.fillStyle = "#ef5b5b";
      ctx.fillRect(x - 1, top - 8, barW + 1, 6);
    }
  });
  // Batch size: dots scaled to the token axis's top (its own maximum written at the top left).
  ctx.fillStyle = "#e6e6e6";
  shown.forEach((s, i) => {
    ctx.fillRect(x0 + i * barW + 1, top + plotH - (s[2] / maxBatch) * plotH - 1, 2, 2);
  });
  ctx.fillText(`batch ≤ ${maxBatch}`, left + 4, top + 10);
  ctx.strokeStyle = "#9be39b";
  ctx.beginPath();
  shown.forEach((s, i) => {
    const x = x0 + i * barW + 1, y = top + plotH - (s[1] / maxTime) * plotH;
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
  // Time ticks: seconds ago under the bars.
  ctx.fillStyle = "#8891a0";
  ctx.textAlign = "center";
  let lastTick = Infinity;
  for (let i = shown.length - 1; i >= 0; i -= 1) {
    const ago = Math.floor(now - shown[i][0]);
    if (ago % 10 === 0 && ago !== lastTick) {
      ctx.fillText(ago === 0 ? "now" : `-${ago}s`, x0 + i * barW, height - 5);
      lastTick = ago;
    }
  }
}

function drawGantt(requests) {
  const gantt = $("gantt");
  gantt.replaceChildren();
  const rows = requests.slice(0, GANTT_ROWS);
  // The span: back to the oldest row's arrival, in tens of seconds, at most a minute.
  const oldest = Math.max(0, ...rows.map((r) => -r.arrival));
  const span = Math.min(GANTT_MAX_SECONDS, Math.max(10, Math.ceil(oldest / 10) * 10));
  $("gantt-span").textContent = span;
  const x = (t) => Math.max(0, Math.min(100, 100 * (1 + t / span)));
  for (const r of rows) {
    const row = document.createElement("div");
    row.className = "grow" + (r.id === selected ? " selected" : "");
    row.dataset.id = r.id;
    const name = document.createElement("div");
    name.className = "name";
    const adapter = r.lora ? ` · ${r.lora}` : "";
    name.textContent = `${r.id} · ${r.tenant}${adapter} · ${r.prompt_tokens}→${r.output_tokens}`;
    name.title = name.textContent;
    const track = document.createElement("div");
    track.className = "track";
    for (const [kind, start, end] of r.segments) {
      if (end < -span) continue;
      const seg = document.createElement("span");
      seg.className = "seg " + kind;
      seg.style.left = x(start) + "%";
      seg.style.width = Math.max(0, x(end) - x(start)) + "%";
      seg.title = `${kind}: ${fmtSec(end - start)}`;
      track.appendChild(seg);
    }
    for (const t of r.chunks) {
      if (t < -span) continue;
      const tick = document.createElement("span");
      tick.className = "chunk";
      tick.style.left = x(t) + "%";
      track.appendChild(tick);
    }
    const reason = document.createElement("div");
    reason.className = "reason " + (r.finish_reason || "");
    reason.textContent = r.finish_reason || (r.ttft === null ? "waiting" : "decoding");
    row.append(name, track, reason);
    row.addEventListener("click", () => showRequest(r.id));
    gantt.appendChild(row);
  }
  if (!requests.length) gantt.innerHTML = '<div class="muted">no requests yet</div>';
}

async function getJson(url) {
  const response = await fetch(url, { headers: authHeaders(), cache: "no-store" });
  let body = null;
  try { body = await response.json(); } catch (error) { body = null; }
  return { status: response.status, body };
}

async function showRequest(id) {
  selected = id;
  $("detail").hidden = false;
  $("detail-id").textContent = id;
  $("detail-summary").textContent = "loading…";
  $("explain").replaceChildren();
  $("timeline").replaceChildren();
  const path = encodeURIComponent(id).replace(/%2F/g, "/");
  const detail = await getJson(`/dashboard/requests/${path}`);
  if (selected !== id) return;
  if (detail.status !== 200) {
    $("detail-summary").textContent = `no longer kept (HTTP ${detail.status})`;
    return;
  }
  const timeline = detail.body.timeline, row = detail.body.row;
  const lora = (timeline || row).lora;
  const adapter = lora ? ` · adapter ${lora}` : "";
  $("detail-summary").textContent = timeline
    ? `tenant ${timeline.tenant}${adapter} · ${timeline.finish_reason} · prompt ${timeline.prompt_tokens} tokens (${timeline.cached_tokens} cached) · output ${timeline.output_tokens} · TTFT ${fmtSec(timeline.ttft_s)} · E2E ${fmtSec(timeline.e2e_s)}`
    : `tenant ${row.tenant}${adapter} · in flight · prompt ${row.prompt_tokens} tokens · output ${row.output_tokens} so far`;
  if (timeline && lastData && lastData.engine.explain) {
    const explain = await getJson(`/v1/requests/${path}/explain`);
    if (selected !== id) return;
    drawExplain(explain);
  } else {
    drawExplain({ status: timeline ? 501 : 404, body: null });
  }
  if (timeline) drawTimeline(timeline);
}

function drawExplain(explain) {
  const box = $("explain");
  if (explain.status !== 200 || !explain.body || !explain.body.parts) {
    const note = document.createElement("div");
    note.className = "muted";
    note.textContent = {
      404: "no breakdown yet: the request is in flight, or no longer kept",
      501: "no breakdown: this server has no /v1/requests/{id}/explain",
    }[explain.status] || `breakdown unavailable (HTTP ${explain.status})`;
    box.appendChild(note);
    return;
  }
  const e = explain.body;
  const cause = document.createElement("div");
  cause.className = "cause";
  cause.textContent = e.main_cause;
  const bar = document.createElement("div");
  bar.className = "parts";
  const total = e.parts.reduce((a, p) => a + p.seconds, 0) || 1;
  const table = document.createElement("table");
  table.innerHTML = "<thead><tr><th>part</th><th>time</th><th>share</th><th style='text-align:left'>detail</th></tr></thead>";
  const body = document.createElement("tbody");
  for (const p of e.parts) {
    const span = document.createElement("span");
    span.className = "part-" + p.name;
    span.style.width = (100 * p.seconds) / total + "%";
    span.title = `${p.name} ${fmtSec(p.seconds)}`;
    bar.appendChild(span);
    const tr = document.createElement("tr");
    for (const [text, align] of [[p.name], [fmtSec(p.seconds)],
                                 [((100 * p.seconds) / (e.e2e_s || total)).toFixed(1) + "%"],
                                 [p.detail || "", "left"]]) {
      const td = document.createElement("td");
      td.textContent = text;
      if (align) td.style.textAlign = align;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  table.appendChild(body);
  box.append(cause, bar, table);
}

// The timeline's events, consecutive decode steps folded into one line.
function drawTimeline(timeline) {
  const folded = [];
  let decoding = false;
  for (const e of timeline.events) {
    if (e.event === "first_token") decoding = true;
    const last = folded[folded.length - 1];
    if (decoding && e.event === "scheduled" && (e.tokens || 0) <= 1) {
      if (last && last.fold) { last.count += 1; last.until = e.t_s; continue; }
      folded.push({ fold: true, t_s: e.t_s, until: e.t_s, count: 1 });
      continue;
    }
    folded.push(e);
  }
  const table = document.createElement("table");
  table.className = "events";
  table.innerHTML = "<thead><tr><th>t</th><th style='text-align:left'>event</th><th>tokens</th></tr></thead>";
  const body = document.createElement("tbody");
  for (const e of folded) {
    const tr = document.createElement("tr");
    const cells = e.fold
      ? [`${fmtSec(e.t_s)} … ${fmtSec(e.until)}`, `decode steps ×${e.count}`, e.count]
      : [fmtSec(e.t_s), e.event, e.tokens === undefined ? "" : e.tokens];
    cells.forEach((text, i) => {
      const td = document.createElement("td");
      td.textContent = text;
      if (i === 1) td.style.textAlign = "left";
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }
  table.appendChild(body);
  const title = document.createElement("h2");
  title.textContent = "Timeline";
  $("timeline").append(title, table);
}

$("detail-close").addEventListener("click", () => {
  selected = null;
  $("detail").hidden = true;
});
window.addEventListener("resize", () => { if (lastData) drawSteps(performance.now() / 1000); });
connect();
