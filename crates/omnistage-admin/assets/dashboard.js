// The omnistage dashboard: polls the admin API and draws the tree, a share chart, latency
// percentiles and the stage graph; a form changes a weight (PUT /api/v1/activities/{path}).
// No framework and no build step: this file is embedded in the binary as it is.
//
// A bearer token, when the server needs one, is read from the URL fragment (#token=...).
// `?set=/path&weight=N` fills the form and submits it once the tree has loaded (used by the
// browser test, and handy for links).
"use strict";

(function () {
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563", "#65a30d", "#9333ea"];
  const hash = new URLSearchParams(location.hash.slice(1));
  if (hash.get("token")) sessionStorage.setItem("omnistage-token", hash.get("token"));
  const token = sessionStorage.getItem("omnistage-token");
  const params = new URLSearchParams(location.search);
  let pendingSet = params.get("set") ? { path: params.get("set"), weight: params.get("weight") } : null;
  const colorOf = new Map();

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    if (token) h["Authorization"] = "Bearer " + token;
    return h;
  }

  async function api(path, opts) {
    const o = Object.assign({}, opts || {});
    o.headers = headers(o.headers);
    const r = await fetch(path, o);
    const text = await r.text();
    let body = null;
    try { body = text ? JSON.parse(text) : null; } catch (e) { body = { error: text }; }
    if (!r.ok) throw new Error(r.status + ": " + ((body && body.error) || r.statusText));
    return body;
  }

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function fmtNs(ns) {
    if (ns === null || ns === undefined) return "–";
    if (ns < 1e3) return ns.toFixed(0) + " ns";
    if (ns < 1e6) return (ns / 1e3).toFixed(1) + " µs";
    if (ns < 1e9) return (ns / 1e6).toFixed(1) + " ms";
    return (ns / 1e9).toFixed(2) + " s";
  }
  function fmtRate(v) {
    if (v === null || v === undefined) return "–";
    if (v >= 1e9) return (v / 1e9).toFixed(1) + "G";
    if (v >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (v >= 1e3) return (v / 1e3).toFixed(1) + "k";
    return v.toFixed(v < 10 ? 1 : 0);
  }
  function fmtPct(f) { return f === null || f === undefined ? "–" : (100 * f).toFixed(1) + "%"; }
  function color(path) {
    if (!colorOf.has(path)) colorOf.set(path, COLORS[colorOf.size % COLORS.length]);
    return colorOf.get(path);
  }

  function flatten(node, depth, out) {
    out.push({ node: node, depth: depth });
    for (const c of node.children) flatten(c, depth + 1, out);
    return out;
  }

  function renderTree(tree) {
    const tbody = document.querySelector("#tree tbody");
    const rows = flatten(tree.root, 0, []);
    tbody.replaceChildren();
    for (const { node: n, depth } of rows) {
      const tr = el("tr", { "data-path": n.path });
      const name = el("td", { class: "path" }, "\u00a0".repeat(depth * 3) + (depth === 0 ? "/" : n.name));
      name.title = n.path;
      tr.append(name);
      tr.append(el("td", { class: "num weight", "data-weight-of": n.path }, String(n.weight)));
      tr.append(el("td", {}, n.policy));
      tr.append(el("td", {}, n.cap ? n.cap.cores.toFixed(2) + " cores (" + n.cap.kind + ")" : ""));
      tr.append(el("td", { class: "num" }, n.cpu_percent === null ? "–" : n.cpu_percent.toFixed(1)));
      const barCell = el("td");
      const bar = el("span", { class: "bar" });
      const fill = el("i");
      fill.style.width = Math.min(100, 100 * (n.share || 0)) + "%";
      bar.append(fill);
      if (n.target_share !== null) {
        const mark = el("b");
        mark.style.left = Math.min(100, 100 * n.target_share) + "%";
        bar.append(mark);
      }
      barCell.append(bar);
      tr.append(barCell);
      tr.append(el("td", { class: "num" }, fmtPct(n.share)));
      tr.append(el("td", { class: "num" }, fmtPct(n.target_share)));
      tr.append(el("td", { class: "num" }, n.rate ? fmtRate(n.rate.messages) : "–"));
      tr.append(el("td", { class: "num" }, n.rate ? fmtRate(n.rate.bytes_out) : "–"));
      tr.append(el("td", { class: "num" }, String(n.queued)));
      tr.append(el("td", { class: "num" }, n.rate ? fmtRate(n.rate.rejected) : "–"));
      const l = n.latency_1s ? n.latency_1s.response_ns : null;
      tr.append(el("td", { class: "num" }, l ? fmtNs(l.p50) : "–"));
      tr.append(el("td", { class: "num" }, l ? fmtNs(l.p90) : "–"));
      tr.append(el("td", { class: "num" }, l ? fmtNs(l.p99) : "–"));
      tbody.append(tr);
    }
    // Latency table: every activity but the root.
    const lt = document.querySelector("#latency tbody");
    lt.replaceChildren();
    for (const { node: n } of rows) {
      if (n.path === "/") continue;
      const tr = el("tr");
      tr.append(el("td", { class: "path" }, n.path));
      tr.append(el("td", { class: "num" }, fmtNs(n.latency.queue_ns.p50)));
      tr.append(el("td", { class: "num" }, fmtNs(n.latency.queue_ns.p90)));
      tr.append(el("td", { class: "num" }, fmtNs(n.latency.response_ns.p50)));
      tr.append(el("td", { class: "num" }, fmtNs(n.latency.response_ns.p90)));
      tr.append(el("td", { class: "num" }, fmtNs(n.latency.response_ns.p99)));
      tr.append(el("td", { class: "num" }, n.latency_1s ? fmtNs(n.latency_1s.response_ns.p90) : "–"));
      lt.append(tr);
    }
    // The form's choices (kept while the user has one selected).
    const sel = document.getElementById("form-path");
    const chosen = sel.value;
    const paths = rows.map((r) => r.node.path).filter((p) => p !== "/");
    if (sel.options.length !== paths.length || paths.some((p, i) => sel.options[i].value !== p)) {
      sel.replaceChildren(...paths.map((p) => el("option", { value: p }, p)));
      // Keep the choice; else start on the first leaf that is not /infra.
      const leaf = rows.find((r) => r.node.children.length === 0 && r.node.path !== "/infra");
      if (paths.includes(chosen)) sel.value = chosen;
      else if (leaf) sel.value = leaf.node.path;
    }
    const w = document.getElementById("form-weight");
    if (!w.value && sel.value) {
      const n = rows.find((r) => r.node.path === sel.value);
      if (n) w.value = n.node.weight;
    }
    const cpu = tree.cpu_ns_per_s === null ? "–" : (tree.cpu_ns_per_s / 1e7).toFixed(0) + "% CPU";
    // Past the API's bound on listed nodes the tree is cut (its totals still count the rest).
    const cut = tree.truncated ? " · " + tree.omitted + " activities not listed (the API's bound)" : "";
    document.getElementById("summary").textContent =
      "up " + tree.uptime_s.toFixed(0) + " s · " + tree.workers + " workers · " + cpu + " charged · tree v" + tree.version + cut;
  }

  function leavesOf(tree) {
    return flatten(tree.root, 0, []).filter((r) => r.node.children.length === 0).map((r) => r.node.path);
  }

  function renderChart(history, plotted) {
    const canvas = document.getElementById("chart");
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 600, h = canvas.clientHeight || 260;
    canvas.width = w * dpr; canvas.height = h * dpr;
    const g = canvas.getContext("2d");
    g.scale(dpr, dpr);
    g.clearRect(0, 0, w, h);
    const left = 40, right = 8, top = 8, bottom = 20;
    const pw = w - left - right, ph = h - top - bottom;
    g.strokeStyle = "#e5e7eb"; g.fillStyle = "#6b7280"; g.font = "11px sans-serif";
    for (let p = 0; p <= 100; p += 25) {
      const y = top + ph * (1 - p / 100);
      g.beginPath(); g.moveTo(left, y); g.lineTo(left + pw, y); g.stroke();
      g.fillText(p + "%", 4, y + 4);
    }
    const pts = history.points;
    if (pts.length < 2) { g.fillText("collecting…", left + 8, top + 16); return; }
    const t0 = pts[0].t_s, t1 = pts[pts.length - 1].t_s;
    const x = (t) => left + pw * (t1 === t0 ? 1 : (t - t0) / (t1 - t0));
    g.fillText("-" + Math.round(t1 - t0) + " s", left, h - 4);
    g.fillText("now", left + pw - 22, h - 4);
    const legend = document.getElementById("legend");
    legend.replaceChildren();
    for (const path of plotted) {
      const c = color(path);
      for (const [key, dash] of [["shares", []], ["targets", [4, 3]]]) {
        g.strokeStyle = c; g.lineWidth = key === "shares" ? 2 : 1; g.setLineDash(dash);
        g.beginPath();
        let started = false;
        for (const p of pts) {
          const v = p[key][path];
          if (v === undefined) { started = false; continue; }
          const px = x(p.t_s), py = top + ph * (1 - Math.min(1, v));
          if (started) g.lineTo(px, py); else { g.moveTo(px, py); started = true; }
        }
        g.stroke();
      }
      g.setLineDash([]);
      const item = el("span");
      const sw = el("i"); sw.style.background = c;
      item.append(sw, document.createTextNode(path));
      legend.append(item);
    }
  }

  function renderGraph(graph) {
    const box = document.getElementById("graph");
    const used = new Set();
    for (const e of graph.edges) { used.add(e.from); used.add(e.to); }
    // Stages nothing was sent to or from are listed under the drawing, not drawn.
    const nodes = graph.nodes.filter((n) => used.has(n.name)).map((n) => n.name);
    const idle = graph.nodes.filter((n) => !used.has(n.name) && n.kind === "stage").map((n) => n.name);
    if (nodes.length === 0) { box.textContent = "no messages yet" + (idle.length ? " (stages: " + idle.join(", ") + ")" : ""); return; }
    // Layers by longest path from the sources (bounded: cycles stop after n rounds).
    const layer = new Map(nodes.map((n) => [n, 0]));
    for (let round = 0; round < nodes.length; round++) {
      let moved = false;
      for (const e of graph.edges) {
        if (e.from === e.to) continue;
        const want = layer.get(e.from) + 1;
        if (want > layer.get(e.to) && want < nodes.length) { layer.set(e.to, want); moved = true; }
      }
      if (!moved) break;
    }
    const cols = new Map();
    for (const n of nodes) { const l = layer.get(n); if (!cols.has(l)) cols.set(l, []); cols.get(l).push(n); }
    const colW = 150, rowH = 46, nodeW = 110, nodeH = 24;
    const ncols = Math.max(...cols.keys()) + 1;
    const nrows = Math.max(...[...cols.values()].map((c) => c.length));
    const W = ncols * colW + 20, H = nrows * rowH + 20;
    const pos = new Map();
    for (const [l, ns] of cols) ns.forEach((n, i) => pos.set(n, { x: 10 + l * colW, y: 10 + i * rowH }));
    const NS = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(NS, "svg");
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    svg.setAttribute("width", "100%");
    svg.innerHTML = '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" markerUnits="userSpaceOnUse" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#64748b"/></marker></defs>';
    const kindOf = new Map(graph.nodes.map((n) => [n.name, n.kind]));
    const outCount = new Map();
    for (const e of graph.edges) {
      const a = pos.get(e.from), b = pos.get(e.to);
      if (!a || !b) continue;
      const path = document.createElementNS(NS, "path");
      let d, lx, ly;
      if (e.from === e.to) {
        d = "M " + (a.x + nodeW - 20) + " " + a.y + " c 10 -22 34 -22 20 0";
        lx = a.x + nodeW - 10; ly = a.y - 16;
      } else {
        const x1 = a.x + nodeW, y1 = a.y + nodeH / 2, x2 = b.x, y2 = b.y + nodeH / 2;
        const mx = (x1 + x2) / 2;
        d = "M " + x1 + " " + y1 + " C " + mx + " " + y1 + " " + mx + " " + y2 + " " + x2 + " " + y2;
        // Labels sit by the source, stacked when a source has several edges.
        const k = outCount.get(e.from) || 0;
        outCount.set(e.from, k + 1);
        lx = x1 + 4; ly = y1 - 4 + 11 * k;
      }
      path.setAttribute("d", d);
      path.setAttribute("fill", "none");
      path.setAttribute("stroke", "#94a3b8");
      path.setAttribute("stroke-width", String(1 + Math.min(3, Math.log10(1 + (e.per_s || 0)) / 2)));
      path.setAttribute("marker-end", "url(#arrow)");
      svg.append(path);
      const t = document.createElementNS(NS, "text");
      t.setAttribute("x", lx); t.setAttribute("y", ly); t.setAttribute("text-anchor", e.from === e.to ? "middle" : "start"); t.setAttribute("fill", "#475569");
      t.textContent = e.per_s === null ? String(e.messages) : fmtRate(e.per_s) + "/s";
      svg.append(t);
    }
    for (const n of nodes) {
      const p = pos.get(n);
      const r = document.createElementNS(NS, "rect");
      r.setAttribute("x", p.x); r.setAttribute("y", p.y); r.setAttribute("width", nodeW); r.setAttribute("height", nodeH);
      r.setAttribute("rx", kindOf.get(n) === "stage" ? 4 : 12);
      r.setAttribute("fill", kindOf.get(n) === "stage" ? "#eff6ff" : "#f1f5f9");
      r.setAttribute("stroke", kindOf.get(n) === "stage" ? "#2563eb" : "#64748b");
      svg.append(r);
      const t = document.createElementNS(NS, "text");
      t.setAttribute("x", p.x + nodeW / 2); t.setAttribute("y", p.y + 16); t.setAttribute("text-anchor", "middle");
      t.textContent = n;
      svg.append(t);
    }
    const note = el("p", { class: "muted" }, idle.length ? "no messages: " + idle.join(", ") : "");
    box.replaceChildren(svg, note);
  }

  let lastTree = null;
  async function refresh() {
    try {
      const [tree, history] = await Promise.all([api("/api/v1/tree"), api("/api/v1/history")]);
      lastTree = tree;
      renderTree(tree);
      renderChart(history, leavesOf(tree).slice(0, COLORS.length));
      document.getElementById("error").textContent = "";
      if (pendingSet) {
        const s = pendingSet;
        pendingSet = null;
        document.getElementById("form-path").value = s.path;
        document.getElementById("form-weight").value = s.weight;
        document.getElementById("weight-form").requestSubmit();
      }
    } catch (e) {
      document.getElementById("error").textContent = "admin API: " + e.message;
    }
  }
  async function refreshGraph() {
    try { renderGraph(await api("/api/v1/graph")); } catch (e) { /* shown by refresh */ }
  }

  document.getElementById("form-path").addEventListener("change", () => {
    const sel = document.getElementById("form-path");
    const n = lastTree && flatten(lastTree.root, 0, []).find((r) => r.node.path === sel.value);
    if (n) document.getElementById("form-weight").value = n.node.weight;
  });

  document.getElementById("weight-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const path = document.getElementById("form-path").value;
    const weight = Number(document.getElementById("form-weight").value);
    const status = document.getElementById("form-status");
    status.className = "";
    status.textContent = "setting…";
    try {
      await api("/api/v1/activities" + path, {
        method: "PUT",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ weight: weight }),
      });
      status.textContent = path + " weight " + weight;
      document.body.dataset.formResult = "ok";
      await refresh();
    } catch (e) {
      status.className = "err";
      status.textContent = e.message;
      document.body.dataset.formResult = "error: " + e.message;
    }
  });

  refresh();
  refreshGraph();
  setInterval(refresh, 1000);
  setInterval(refreshGraph, 2000);
})();
