// trahiv dashboard: polls the JSON API (paths in #dashboard's data attributes) and redraws; charts by uPlot.
"use strict";
(() => {
  const root = document.getElementById("dashboard");
  const api = { summary: root.dataset.summary, steps: root.dataset.steps, leaderboard: root.dataset.leaderboard,
    diloco: root.dataset.diloco };
  const refreshMs = Number(root.dataset.refreshMs);
  const maxPoints = Number(root.dataset.maxPoints);
  const $ = (id) => document.getElementById(id);

  // --- formatting -------------------------------------------------------------------------------------------------

  const integer = (n) => Math.round(n).toLocaleString("en-US");

  function duration(seconds) {
    const s = Math.max(0, Math.round(seconds));
    if (s < 90) return s + " s";
    const m = Math.round(s / 60);
    if (m < 90) return m + " min";
    const h = Math.floor(s / 3600), mm = Math.round((s % 3600) / 60);
    if (h < 48) return h + " h " + mm + " min";
    return Math.floor(h / 24) + " d " + (h % 24) + " h";
  }

  function rate(value) {
    if (value === null || value === undefined) return "–";
    return value >= 100 ? integer(value) : value.toFixed(1);
  }

  function clock(unixSeconds) {
    const date = new Date(unixSeconds * 1000);
    const sameDay = date.toDateString() === new Date().toDateString();
    const time = date.toLocaleTimeString("en-GB", { hour: "2-digit", minute: "2-digit" });
    return sameDay ? time : date.toLocaleDateString("en-CA") + " " + time;
  }

  function setText(id, text) {
    $(id).textContent = text;
  }

  // --- charts -----------------------------------------------------------------------------------------------------

  // ticks at whole numbers only (steps, peers)
  const wholeIncrements = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];

  function chart(id, label, color, xIsTime, yIsCount) {
    const element = $(id);
    const series = { label, stroke: color, width: 2, spanGaps: true, points: { size: 4 } };
    if (yIsCount) series.paths = uPlot.paths.stepped({ align: 1 });
    const x = { stroke: "#5b6270" }, y = { stroke: "#5b6270", size: 56 };
    if (!xIsTime) x.incrs = wholeIncrements;
    if (yIsCount) y.incrs = wholeIncrements;
    const options = {
      width: Math.max(element.clientWidth, 200),
      height: 220,
      scales: { x: { time: xIsTime } },
      series: [{ label: xIsTime ? "time" : "step" }, series],
      axes: [x, y],
      legend: { show: true },
    };
    const plot = new uPlot(options, [[], []], element);
    new ResizeObserver(() => plot.setSize({ width: Math.max(element.clientWidth, 200), height: 220 })).observe(element);
    return {
      update(xs, ys) {
        plot.setData([xs, ys]);
        element.dataset.points = String(ys.filter((y) => y !== null).length);
      },
    };
  }

  const charts = {
    loss: chart("loss-chart", "loss", "#2457a6", false, false),
    peers: chart("peers-chart", "active peers", "#c47f17", true, true),
    throughput: chart("throughput-chart", "samples/s", "#2f8a57", true, false),
  };

  function renderCharts(steps) {
    charts.loss.update(steps.map((s) => s.step), steps.map((s) => s.loss));
    const byTime = [...steps].sort((a, b) => a.time - b.time);
    const times = byTime.map((s) => s.time);
    charts.peers.update(times, byTime.map((s) => s.active_peers));
    charts.throughput.update(times, byTime.map((s) => s.samples_per_second));
  }

  // --- cards and leaderboard --------------------------------------------------------------------------------------

  function renderSummary(s) {
    setText("run-id", s.run_id || "");
    if (s.run_id) document.title = s.run_id + " · trahiv dashboard";
    $("empty").hidden = s.step !== null;
    setText("step", s.step === null ? "–" : integer(s.step));
    setText("max-steps", s.max_steps === null ? "" : " / " + integer(s.max_steps));
    $("progress-bar").style.width = ((s.progress || 0) * 100).toFixed(1) + "%";
    if (s.eta_seconds === 0) setText("eta", "reached");
    else if (s.eta_seconds !== null) setText("eta", duration(s.eta_seconds));
    else setText("eta", s.max_steps === null ? "no max_steps" : "measuring…");
    setText("eta-detail", s.eta_time !== null && s.eta_seconds > 0 ? "around " + clock(s.eta_time) : "");
    setText("active-peers", s.active_peers === null ? "–" : String(s.active_peers));
    setText("contributors-count", s.contributors + (s.contributors === 1 ? " contributor" : " contributors") +
      " so far");
    setText("throughput", rate(s.samples_per_second));
    const perHour = root.dataset.stepWord === "outer step" ? " outer steps/h" : " steps/h";
    setText("step-rate", s.steps_per_hour === null ? "" : rate(s.steps_per_hour) + perHour);
    setText("loss", s.loss === null ? "–" : s.loss.toFixed(3));
    setText("total-samples", integer(s.total_samples) + " samples in all");
    const age = s.last_step_time === null ? "" : " · latest step " + duration(s.server_time - s.last_step_time) +
      " ago";
    setText("status", "updated " + new Date().toLocaleTimeString("en-GB") + age);
  }

  function cell(text, className) {
    const td = document.createElement("td");
    td.textContent = text;
    if (className) td.className = className;
    return td;
  }

  function contributorRow(c, serverTime) {
    const tr = document.createElement("tr");
    tr.dataset.peerId = c.peer_id;
    tr.dataset.rank = String(c.rank);
    const name = cell(c.name || "peer …" + c.peer_id.slice(-8), "name");
    const id = document.createElement("span");
    id.className = "id";
    id.textContent = c.peer_id;
    name.appendChild(id);
    const share = cell("", "share");
    const bar = document.createElement("div");
    bar.className = "share-bar";
    bar.style.width = (c.share * 100).toFixed(1) + "%";
    const shareText = document.createElement("span");
    shareText.className = "share-text";
    shareText.textContent = (c.share * 100).toFixed(1) + "%";
    share.append(bar, shareText);
    tr.append(cell(String(c.rank), "rank"), name, cell(c.device || "–", "device"), cell(integer(c.samples),
      "num samples"), share, cell(duration(c.seconds), "num seconds"),
      cell(duration(serverTime - c.last_seen) + " ago", "num last-seen"));
    return tr;
  }

  function renderLeaderboard(board, serverTime) {
    const rows = board.contributors.map((c) => contributorRow(c, serverTime));
    document.querySelector("#leaderboard tbody").replaceChildren(...rows);
    $("no-contributors").hidden = rows.length > 0;
  }

  function bytes(n) {
    const units = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
    return (i === 0 ? String(n) : n.toFixed(1)) + " " + units[i];
  }

  function renderDiloco(d, serverTime) {  // DiLoCo swarms: each peer's outer step and averaging bytes
    $("diloco-board").hidden = !d.diloco;
    // a DiLoCo swarm's steps (metrics records, loss curve, max_steps) are outer steps
    const word = d.diloco ? "outer step" : "collaborative step";
    setText("step-label", word[0].toUpperCase() + word.slice(1));
    document.querySelectorAll(".step-word").forEach((span) => { span.textContent = word; });
    root.dataset.stepWord = word;
    const rows = d.peers.map((p) => {
      const tr = document.createElement("tr");
      tr.append(cell("peer …" + p.peer_id.slice(-8), "name"), cell(integer(p.outer_step), "num outer-step"),
        cell(p.inner_done + " / " + p.inner_steps, "num inner"), cell(bytes(p.bytes_sent), "num sent"),
        cell(bytes(p.bytes_received), "num received"), cell(duration(Math.max(serverTime - p.last_seen, 0)) + " ago",
          "num last-seen"));
      return tr;
    });
    document.querySelector("#diloco tbody").replaceChildren(...rows);
  }

  // --- polling ----------------------------------------------------------------------------------------------------

  async function getJson(path) {
    const response = await fetch(path, { cache: "no-store" });
    if (!response.ok) throw new Error(path + " answered " + response.status);
    return response.json();
  }

  async function refresh() {
    try {
      const [summary, steps, board, diloco] = await Promise.all([
        getJson(api.summary), getJson(api.steps + "?limit=" + maxPoints), getJson(api.leaderboard),
        getJson(api.diloco),
      ]);
      renderDiloco(diloco, summary.server_time);  // (first: it names the steps the others show)
      renderSummary(summary);
      renderCharts(steps.steps);
      renderLeaderboard(board, summary.server_time);
      $("error").hidden = true;
      root.dataset.loaded = "true";
    } catch (error) {
      setText("error", "The dashboard server did not answer (" + error.message + "); retrying.");
      $("error").hidden = false;
    } finally {
      setTimeout(refresh, refreshMs);
    }
  }

  setText("refresh", duration(refreshMs / 1000));
  refresh();
})();
