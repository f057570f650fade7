// The coordinator's dashboard: reads the JSON API every few seconds and draws it with uPlot
// (served by the coordinator itself from static/vendor/; no CDN). Charts over a time window
// (15 min to 24 h) with time axes; per-round charts by round number.
"use strict";

const REFRESH_MS = 3000;
const COLORS = { compute: "#3367d6", matchmaking: "#f4b400", allreduce: "#0f9d58", landing: "#db4437" };
let windowS = 3600;
if (typeof uPlot === "undefined") {  // installed without `make web`: say so instead of failing silently
  document.querySelectorAll(".chart .empty").forEach(e => {
    e.textContent = "charts need the dashboard's charting library: run `make web` in the source tree, then reinstall";
  });
}
const charts = {};
window.swarmCharts = charts;  // for the browser test: each chart's data

function fmtSeconds(s) {
  if (s === null || s === undefined) return "-";
  if (s < 90) return s.toFixed(0) + " s";
  if (s < 5400) return (s / 60).toFixed(0) + " min";
  if (s < 172800) return (s / 3600).toFixed(1) + " h";
  return (s / 86400).toFixed(1) + " days";
}
function fmtNumber(n, digits = 1) {
  if (n === null || n === undefined) return "-";
  const units = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
  for (const [size, unit] of units) if (Math.abs(n) >= size) return (n / size).toFixed(digits) + " " + unit;
  return n.toFixed(digits);
}
function fmtBytes(n) { return n === null || n === undefined ? "-" : fmtNumber(n, 1) + "B"; }
function setFigure(id, text) { document.getElementById(id).firstChild.textContent = text; }

function chart(id, opts, data) {
  if (typeof uPlot === "undefined") return;
  const box = document.getElementById(id);
  const points = data[0].length;
  box.dataset.points = String(points);
  document.getElementById(id.replace("-chart", "-empty")).textContent = points ? "" : "no data in this window yet";
  const width = Math.max(420, Math.min(720, box.parentElement.clientWidth || 560));
  if (!charts[id] || charts[id].series.length !== opts.series.length) {
    if (charts[id]) charts[id].destroy();
    charts[id] = new uPlot({ width, height: 240, ...opts }, data, box);
  } else {
    charts[id].setData(data);
  }
}

function timeAxis() { return { scales: { x: { time: true } }, axes: [{ label: "time" }] }; }
function roundAxis() { return { scales: { x: { time: false } } }; }

function drawLoss(rounds, history) {
  const rows = rounds.filter(r => r.mean_loss !== null || r.validation_loss !== null);
  chart("loss-chart", {
    ...timeAxis(),
    series: [{ label: "finalized" },
      { label: "training loss (mean reporter)", stroke: COLORS.compute, width: 2, spanGaps: true },
      { label: "validation loss", stroke: COLORS.landing, width: 2, spanGaps: true, points: { show: true } }],
    axes: [{ label: "time" }, { label: "loss" }],
  }, [rows.map(r => r.finalized_at), rows.map(r => r.mean_loss), rows.map(r => r.validation_loss)]);
}

function drawThroughput(history, tokensPerSample) {
  const series = [{ label: "time" },
    { label: "samples/s", stroke: COLORS.compute, width: 2, scale: "rate" },
    { label: "peers online", stroke: COLORS.allreduce, width: 2, scale: "peers", paths: uPlot.paths.stepped({ align: 1 }) }];
  const data = [history.map(p => p.at), history.map(p => p.samples_per_second), history.map(p => p.peers_online)];
  if (tokensPerSample) {
    series.push({ label: "tokens/s", stroke: "#9334e6", width: 1, scale: "tokens", dash: [6, 4] });
    data.push(history.map(p => p.samples_per_second * tokensPerSample));
  }
  const axes = [{ label: "time" }, { scale: "rate", label: "samples/s" },
    { scale: "peers", label: "peers", side: 1, grid: { show: false } }];
  chart("throughput-chart", { scales: { x: { time: true }, peers: { range: (u, lo, hi) => [0, Math.max(1, hi) + 1] } },
    series, axes }, data);
}

function drawSplit(rounds) {
  const rows = rounds.filter(r => r.compute_s !== null);
  const parts = ["compute_s", "matchmaking_s", "allreduce_s", "landing_s"];
  const names = ["compute (inner steps)", "matchmaking", "all-reduce", "landing (host)"];
  const colors = [COLORS.compute, COLORS.matchmaking, COLORS.allreduce, COLORS.landing];
  // stacked bars: series k draws the sum of parts 0..k; the tallest is drawn first
  const stacked = parts.map((_, k) => rows.map(r => parts.slice(0, k + 1).reduce((s, p) => s + (r[p] || 0), 0)));
  const order = [3, 2, 1, 0];
  const bars = uPlot.paths.bars({ size: [0.7, 40] });
  chart("split-chart", {
    ...roundAxis(),
    series: [{ label: "round" }, ...order.map(k => ({
      label: names[k], fill: colors[k], stroke: colors[k], paths: bars, points: { show: false },
      value: (u, v, si, i) => i === null || i === undefined || !rows[i] ? "-" : (rows[i][parts[k]] || 0).toFixed(2) + " s",
    }))],
    axes: [{ label: "round" }, { label: "seconds" }],
  }, [rows.map(r => r.round), ...order.map(k => stacked[k])]);
}

function drawBytes(rounds) {
  const rows = rounds.filter(r => r.bytes_sent !== null);
  chart("bytes-chart", {
    ...roundAxis(),
    series: [{ label: "round" },
      { label: "sent", stroke: COLORS.compute, width: 2, points: { show: true }, value: (u, v) => fmtBytes(v) },
      { label: "received", stroke: COLORS.allreduce, width: 2, points: { show: true }, value: (u, v) => fmtBytes(v) }],
    axes: [{ label: "round" }, { label: "bytes", values: (u, ticks) => ticks.map(fmtBytes), size: 70 }],
  }, [rows.map(r => r.round), rows.map(r => r.bytes_sent), rows.map(r => r.bytes_received)]);
}

function drawFailed(history, rounds) {
  // failed rounds: what the peers' heartbeats said, since the coordinator started (cumulative);
  // split rounds: finalized rounds whose granted reporters landed more than one state
  const base = history.length ? history[0].rounds_failed : 0;
  const splitAt = rounds.filter(r => (r.states || 0) > 1).map(r => r.finalized_at).sort((a, b) => a - b);
  const split = history.map(p => splitAt.filter(t => t <= p.at).length);
  chart("failed-chart", {
    scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, Math.max(1, hi) + 1] } },
    series: [{ label: "time" },
      { label: "failed rounds (peers' count, in this window)", stroke: COLORS.landing, width: 2, paths: uPlot.paths.stepped({ align: 1 }) },
      { label: "split rounds (in this window)", stroke: COLORS.matchmaking, width: 2, paths: uPlot.paths.stepped({ align: 1 }) }],
    axes: [{ label: "time" }, { label: "rounds" }],
  }, [history.map(p => p.at), history.map(p => p.rounds_failed - base), split]);
}

function rows(table, data, cells, numeric = []) {
  const body = table.querySelector("tbody");
  body.replaceChildren(...data.map(item => {
    const tr = document.createElement("tr");
    cells(item).forEach((value, i) => {
      const td = document.createElement("td");
      if (value instanceof Node) td.appendChild(value); else td.textContent = value;
      if (numeric.includes(i)) td.className = "num";
      tr.appendChild(td);
    });
    return tr;
  }));
}
function bar(fraction) {
  const span = document.createElement("span");
  span.className = "bar"; span.style.width = Math.round(120 * fraction) + "px";
  return span;
}

async function get(path) { const r = await fetch(path); if (!r.ok) throw new Error(path + ": " + r.status); return r.json(); }

function showModel(model) {
  const exported = document.querySelector("#model span");
  if (model.round !== null) {
    exported.replaceChildren(document.createTextNode("round " + model.round + " (" + model.architecture + ", " +
      model.parameters.toLocaleString() + " parameters, transformers' from_pretrained loads it): "));
    model.files.forEach((f, i) => {
      const a = document.createElement("a"); a.href = f.url; a.textContent = f.name; a.download = f.name;
      if (i) exported.appendChild(document.createTextNode(", "));
      exported.appendChild(a);
    });
  } else if (model.last_error) {
    exported.textContent = "export failed: " + model.last_error;
  }
}

function showFigures(status) {
  document.getElementById("run").textContent = "swarmtrain: " + status.run_name;
  document.getElementById("digest").textContent = status.spec_digest;
  document.getElementById("updated").textContent = "updated " + new Date(status.server_time * 1000).toLocaleTimeString();
  setFigure("round", status.current_round);
  setFigure("online", status.peers_online);
  setFigure("throughput", status.samples_per_second.toFixed(1));
  setFigure("pace", status.rounds_per_hour.toFixed(1));
  const p = status.progress;
  setFigure("tokens", p && p.tokens_per_sample ? fmtNumber(p.tokens_per_second) : "n/a");
  if (!p || p.end === "none") { setFigure("eta", "runs until stopped"); setFigure("done", "-"); }
  else {
    const ends = p.eta_s === null ? "- (idle)" : p.eta_s === 0 ? "done" :
      fmtSeconds(p.eta_s) + " (" + new Date((status.server_time + p.eta_s) * 1000).toLocaleString() + ")";
    setFigure("eta", ends);
    setFigure("done", (100 * p.fraction).toFixed(1) + "% of " + (p.end === "tokens" ? fmtNumber(p.target, 2) + " tokens" : p.target + " rounds"));
  }
  setFigure("checkpoint", status.last_checkpoint_round === null ? "none" : status.last_checkpoint_round);
  setFigure("val", status.validation_loss === null ? "none" : status.validation_loss.toFixed(3) + " @" + status.validation_round);
  setFigure("data", status.data === null ? "n/a" :
    fmtNumber(status.data.tokens_trained, 2) + " (" + status.data.epoch.toFixed(3) + ")");
  const join = document.getElementById("join");
  join.style.display = status.peers_online === 0 && status.join ? "block" : "none";
  if (status.join) {
    document.getElementById("join-command").textContent = "swarmtrain peer --coordinator " + location.hostname + ":" +
      (status.join.grpc_port || "PORT") + " --coordinator-key " + status.join.coordinator_key;
  }
}

function showTables(status, peers, credits) {
  rows(document.getElementById("rounds"), status.rounds, r => [r.round + (r.decided ? "" : " (reports coming)"),
    r.groups, r.states + (r.states > 1 ? " (split)" : ""), r.peers_averaged, r.reports]);
  status.rounds.forEach((r, i) =>
    document.querySelectorAll("#rounds tbody tr")[i].classList.toggle("split", r.states > 1));
  const paths = Object.entries(status.network_paths).sort((a, b) => b[1] - a[1]);
  const online = paths.reduce((s, [, n]) => s + n, 0) || 1;
  rows(document.getElementById("paths"), paths, ([path, n]) => [path, n, bar(n / online)], [1]);
  const total = Object.values(credits.by_peer).reduce((s, c) => s + c.samples, 0) || 1;
  rows(document.getElementById("credits"), credits.leaderboard, c => [c.account_key.slice(0, 20) + "…", c.peers,
    c.samples.toLocaleString(), (100 * c.samples / total).toFixed(1) + "%", c.flops.toExponential(2)], [1, 2, 3, 4]);
  const now = status.server_time;
  rows(document.getElementById("peers"), peers, p => [p.key.slice(0, 20) + "…", p.state, p.local_ranks, p.samples_per_second.toFixed(1),
    (p.network_path || (p.reachable ? "reachable" : "client mode")) + (p.punched_peers ? ", hole-punched to " + p.punched_peers : "") + (p.relay ? " (relays for others)" : ""), p.software_version, Math.round(now - p.last_seen) + " s ago",
    p.offences + (p.flagged ? " (flagged)" : "")]);
}

async function refresh() {
  const limit = Math.min(5000, Math.max(200, Math.ceil(windowS / 5)));
  const [status, peers, rounds, credits, history, model] = await Promise.all(
    ["api/v1/status", "api/v1/peers", "api/v1/rounds?limit=" + limit, "api/v1/credits",
      "api/v1/history?seconds=" + windowS, "api/v1/model"].map(get));
  const since = status.server_time - windowS;
  const inWindow = rounds.filter(r => r.finalized_at >= since).reverse();  // oldest first
  showFigures(status);
  showModel(model);
  drawLoss(inWindow, history);
  drawThroughput(history, status.progress ? status.progress.tokens_per_sample : null);
  drawSplit(inWindow);
  drawBytes(inWindow);
  drawFailed(history, inWindow);
  showTables(status, peers, credits);
}

for (const button of document.querySelectorAll("#window button")) {
  button.addEventListener("click", () => {
    windowS = Number(button.dataset.s);
    document.querySelectorAll("#window button").forEach(b => b.classList.toggle("on", b === button));
    refresh().catch(e => console.error(e));
  });
}
refresh().catch(e => console.error(e));
setInterval(() => refresh().catch(e => console.error(e)), REFRESH_MS);
