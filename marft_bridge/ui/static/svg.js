// SVG drawing for marft ui: the dependency graph D of one episode, and metric line plots.
// Hand-written, no libraries: the page must work without any network.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs, text) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined) el.setAttribute(k, String(v));
  }
  if (text !== undefined) el.textContent = text;
  return el;
}

const G = { colW: 190, rowH: 44, nodeW: 158, nodeH: 30, left: 150, top: 34, lanePad: 8 };

// The outline of a node: kinds are told apart by shape (and colour, in style.css).
function nodeShape(kind, w, h) {
  if (kind === "tool") {
    const d = 10;
    return svgEl("polygon", { class: "shape",
      points: `${d},0 ${w - d},0 ${w},${h / 2} ${w - d},${h} ${d},${h} 0,${h / 2}` });
  }
  if (kind === "message") return svgEl("rect", { class: "shape", width: w, height: h, rx: h / 2, ry: h / 2 });
  if (kind === "env") return svgEl("rect", { class: "shape", width: w, height: h, rx: 0, ry: 0 });
  return svgEl("rect", { class: "shape", width: w, height: h, rx: 6, ry: 6 });
}

function clip(text, n) {
  text = text || "";
  return text.length > n ? text.slice(0, n - 1) + "…" : text;
}

// graph: the API's episode.graph; credited: Set of action ids on the highlighted reward path;
// onPick(node) is called when a node is clicked.
function drawGraph(graph, credited, onPick) {
  const laneTop = [];
  let y = G.top;
  for (const lane of graph.lanes) {
    laneTop.push(y);
    y += Math.max(1, lane.rows) * G.rowH + G.lanePad;
  }
  const width = G.left + graph.steps.length * G.colW + 20;
  const height = y + 6;
  const svg = svgEl("svg", { id: "graph", class: graph.collapsed ? "graph collapsed" : "graph",
    width, height, viewBox: `0 0 ${width} ${height}`, "data-nodes": graph.nodes.length,
    "data-edges": graph.edges.length });
  const defs = svgEl("defs");
  const marker = svgEl("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 8,
    markerHeight: 8, markerUnits: "userSpaceOnUse", orient: "auto-start-reverse" });
  marker.appendChild(svgEl("path", { d: "M0,0 L10,5 L0,10 z", class: "arrowhead" }));
  defs.appendChild(marker);
  svg.appendChild(defs);

  graph.lanes.forEach((lane, i) => {
    const h = Math.max(1, lane.rows) * G.rowH;
    svg.appendChild(svgEl("rect", { class: `lane lane-${i % 2}`, x: 0, y: laneTop[i] - 4, width, height: h }));
    svg.appendChild(svgEl("text", { class: "lane-label", x: 8, y: laneTop[i] + G.nodeH / 2 + 4 },
      clip(lane.agent, 20)));
  });
  graph.steps.forEach((s, c) => {
    svg.appendChild(svgEl("text", { class: "step-label", x: G.left + c * G.colW + G.nodeW / 2, y: 20,
      "text-anchor": "middle" }, `step ${s}`));
  });

  const pos = {}, index = {};
  for (const n of graph.nodes) {
    pos[n.id] = { x: G.left + n.col * G.colW, y: laneTop[n.lane] + n.slot * G.rowH, col: n.col };
    index[n.id] = n.index;
  }
  const edges = svgEl("g", { class: "edges" });
  for (const e of graph.edges) {
    const a = pos[e.from], b = pos[e.to];
    if (!a || !b) continue;
    let d;
    if (a.col === b.col) {  // same step: loop out to the right of the column
      const x = a.x + G.nodeW, y1 = a.y + G.nodeH / 2, y2 = b.y + G.nodeH / 2;
      d = `M${x},${y1} C${x + 30},${y1} ${x + 30},${y2} ${x},${y2}`;
    } else {
      const x1 = a.x + G.nodeW, y1 = a.y + G.nodeH / 2, x2 = b.x, y2 = b.y + G.nodeH / 2;
      const mid = (x1 + x2) / 2;
      d = `M${x1},${y1} C${mid},${y1} ${mid},${y2} ${x2},${y2}`;
    }
    const on = credited.has(e.from) && credited.has(e.to);
    const path = svgEl("path", { class: "edge" + (on ? " credited" : ""), d, "marker-end": "url(#arrow)",
      "data-from": e.from, "data-to": e.to, "data-count": e.count || 1 });
    path.appendChild(svgEl("title", {}, e.count ? `${e.count} dependencies`
      : `#${index[e.from]} → #${index[e.to]} (${e.from} → ${e.to})`));
    edges.appendChild(path);
  }
  svg.appendChild(edges);

  for (const n of graph.nodes) {
    const p = pos[n.id];
    const cls = ["node", `kind-${n.kind}`];
    if (graph.collapsed ? false : credited.has(n.id)) cls.push("credited");
    if (n.error || n.errors) cls.push("has-error");
    const attrs = { class: cls.join(" "), transform: `translate(${p.x},${p.y})`, "data-kind": n.kind,
      "data-agent": n.agent, "data-step": n.step, tabindex: 0 };
    if (graph.collapsed) attrs["data-group"] = n.id; else attrs["data-action-id"] = n.id;
    const g = svgEl("g", attrs);
    g.appendChild(nodeShape(n.kind, G.nodeW, G.nodeH));
    const label = graph.collapsed
      ? `${n.count} actions (${Object.entries(n.kinds).map(([k, v]) => `${v} ${k}`).join(", ")})`
      : `#${n.index} ${n.kind}: ${n.label || ""}`;
    g.appendChild(svgEl("text", { x: 8, y: G.nodeH / 2 + 4 }, clip(label, 24)));
    g.appendChild(svgEl("title", {}, graph.collapsed ? label : `#${n.index} ${n.agent} (${n.kind}) ${n.label || ""}`));
    g.addEventListener("click", () => onPick(n));
    g.addEventListener("keydown", (ev) => { if (ev.key === "Enter") onPick(n); });
    svg.appendChild(g);
  }
  return svg;
}

function niceNumber(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1000 || a < 0.001) return v.toExponential(2);
  return String(Number(v.toPrecision(3)));
}

// One metric over updates: points [[update, value], ...].
function linePlot(metric, points) {
  const W = 330, H = 190, L = 52, R = 10, T = 24, B = 30;
  const svg = svgEl("svg", { class: "plot", width: W, height: H, viewBox: `0 0 ${W} ${H}`,
    "data-metric": metric, "data-points": points.length });
  svg.appendChild(svgEl("text", { class: "plot-title", x: L, y: 15 }, metric));
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  svg.appendChild(svgEl("rect", { class: "plot-area", x: L, y: T, width: W - L - R, height: H - T - B }));
  for (const v of [y0, (y0 + y1) / 2, y1]) {
    svg.appendChild(svgEl("line", { class: "grid", x1: L, x2: W - R, y1: sy(v), y2: sy(v) }));
    svg.appendChild(svgEl("text", { class: "tick", x: L - 4, y: sy(v) + 4, "text-anchor": "end" }, niceNumber(v)));
  }
  for (const v of [x0, x1]) {
    svg.appendChild(svgEl("text", { class: "tick", x: sx(v), y: H - B + 14, "text-anchor": "middle" }, niceNumber(v)));
  }
  svg.appendChild(svgEl("text", { class: "tick", x: (L + W - R) / 2, y: H - 3, "text-anchor": "middle" }, "update"));
  svg.appendChild(svgEl("polyline", { class: "series",
    points: points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ") }));
  if (points.length <= 80) {
    for (const p of points) {
      const c = svgEl("circle", { class: "point", cx: sx(p[0]), cy: sy(p[1]), r: 2.5 });
      c.appendChild(svgEl("title", {}, `update ${p[0]}: ${p[1]}`));
      svg.appendChild(c);
    }
  }
  return svg;
}
