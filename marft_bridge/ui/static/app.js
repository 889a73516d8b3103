// marft ui: the page. Hash routes: #/episodes, #/episode/<id>[?action=<id>], #/runs[/<name>], #/adapters.
// Everything it shows comes from the read-only /api; text is always set as text, never as HTML.
"use strict";

const view = document.getElementById("view");
const state = { cursor: null, filters: {}, offset: 0, fresh: new Set() };

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

async function api(path) {
  const r = await fetch(path, { credentials: "same-origin" });
  const body = await r.json().catch(() => ({ error: `HTTP ${r.status}` }));
  if (!r.ok) throw new Error(body.error || `HTTP ${r.status}`);
  return body;
}

const fmtTime = (iso) => (iso ? iso.replace("T", " ").replace(/\.\d+/, "").replace("+00:00", "Z") : "");
const fmtNum = (v) => (v === null || v === undefined ? "–" : Number.isInteger(v) ? String(v) : v.toFixed(4));
// Ids that capture makes are time-ordered (their first digits are the time), so ids made in the same
// minute share a prefix: a short id is the shortest end (8 characters or more) that no other id of
// the same list ends with. The full id stays in the link and on hover.
function shortIds(ids) {
  const long = [...new Set(ids)].filter((id) => id.length > 16);
  const out = new Map();
  for (const id of long) {
    let n = 8;
    while (n < id.length && long.some((o) => o !== id && o.endsWith(id.slice(-n)))) n += 1;
    out.set(id, n < id.length ? `…${id.slice(-n)}` : id);
  }
  return (id) => out.get(id) || id;
}
// An action within its episode: its index, with the full id on hover.
const actionRef = (k, id) => h("span", { class: "mono", title: id }, `#${k}`);
const json = (v) => JSON.stringify(v, null, 2);

function showError(e) {
  view.replaceChildren(h("div", { class: "panel err" }, String(e.message || e)));
}

function setNav(name) {
  for (const n of ["episodes", "runs", "adapters"]) {
    document.getElementById(`nav-${n}`).classList.toggle("active", n === name);
  }
}

// -- episodes list -------------------------------------------------------------------------------

const FILTERS = [
  ["q", "search id / task", "text"], ["source", "source", "select"], ["agent", "agent", "select"],
  ["version", "adapter version", "select"], ["status", "status", "select"], ["has_reward", "reward", "select"],
  ["reward_min", "reward ≥", "number"], ["reward_max", "reward ≤", "number"],
  ["since", "since (ISO or 7d)", "text"], ["until", "until (ISO or 1h)", "text"], ["errors", "errors only", "checkbox"],
];

function filterForm(choices) {
  const opts = {
    source: choices.sources, agent: choices.agents, version: choices.versions,
    status: ["completed", "running", "failed"], has_reward: ["true", "false"],
  };
  const form = h("form", { class: "filters", id: "filters", onsubmit: (e) => { e.preventDefault(); } });
  for (const [name, label, type] of FILTERS) {
    let input;
    if (type === "select") {
      input = h("select", { name }, h("option", { value: "" }, "any"),
        (opts[name] || []).map((v) => h("option", { value: v, selected: state.filters[name] === v }, v)));
    } else if (type === "checkbox") {
      input = h("input", { type, name, checked: state.filters[name] === "true" });
    } else {
      input = h("input", { type, name, value: state.filters[name] || "", step: type === "number" ? "any" : null,
        size: name === "q" ? 18 : 8 });
    }
    input.addEventListener("change", () => readFilters(form));
    if (type === "text") input.addEventListener("keyup", (e) => { if (e.key === "Enter") readFilters(form); });
    form.appendChild(h("label", {}, label, input));
  }
  form.appendChild(h("button", { type: "button", onclick: () => { state.filters = {}; state.offset = 0; renderEpisodes(); } }, "clear"));
  return form;
}

function readFilters(form) {
  const f = {};
  for (const el of form.elements) {
    if (!el.name) continue;
    if (el.type === "checkbox") { if (el.checked) f[el.name] = "true"; } else if (el.value) f[el.name] = el.value;
  }
  state.filters = f;
  state.offset = 0;
  renderEpisodes();
}

function chips(title, counts, filter) {
  const entries = Object.entries(counts).sort((a, b) => b[1] - a[1]);
  return h("div", { class: "chips", "data-counts": filter },
    h("span", { class: "muted" }, title + ":"),
    entries.length ? entries.map(([k, n]) => h("span", { class: "chip", "data-value": k, "data-count": n,
      onclick: () => { state.filters[filter] = k; state.offset = 0; renderEpisodes(); } }, k, " ", h("b", {}, n)))
      : h("span", { class: "muted" }, "none"));
}

function episodeRow(r, short) {
  const open = () => { location.hash = `#/episode/${encodeURIComponent(r.id)}`; };
  return h("tr", { class: "clickable" + (state.fresh.has(r.id) ? " new" : ""), "data-episode-id": r.id, onclick: open },
    h("td", { class: "mono" }, h("a", { href: `#/episode/${encodeURIComponent(r.id)}`, title: r.id }, short(r.id))),
    h("td", {}, fmtTime(r.started_at)), h("td", {}, r.source), h("td", {}, r.status),
    h("td", {}, r.agents.join(", ")),
    h("td", {}, String(r.n_actions), " ", h("span", { class: "muted" },
      Object.entries(r.kinds).map(([k, n]) => `${n} ${k}`).join(", "))),
    h("td", {}, fmtNum(r.reward)), h("td", { class: "mono" }, r.versions.join(" ")),
    h("td", { class: r.action_errors || r.capture_errors ? "err" : "" },
      r.action_errors || r.capture_errors ? `${r.action_errors + r.capture_errors}` : ""),
    h("td", { class: "muted" }, r.task.slice(0, 80)));
}

async function renderEpisodes() {
  setNav("episodes");
  const params = new URLSearchParams({ ...state.filters, offset: state.offset, limit: 50 });
  const data = await api(`/api/episodes?${params}`);
  if (state.cursor === null) state.cursor = data.cursor;
  const short = shortIds(data.items.map((r) => r.id));
  const table = h("table", { id: "episodes" },
    h("thead", {}, h("tr", {}, ["id", "started", "source", "status", "agents", "actions", "reward", "versions",
      "errors", "task"].map((c) => h("th", {}, c)))),
    h("tbody", {}, data.items.map((r) => episodeRow(r, short))));
  const pager = h("div", { class: "pager" },
    h("button", { disabled: state.offset === 0, onclick: () => { state.offset = Math.max(0, state.offset - 50); renderEpisodes(); } }, "‹ newer"),
    h("span", { id: "episode-total" }, `${data.total ? data.offset + 1 : 0}–${data.offset + data.items.length} of ${data.total}`,
      h("span", { class: "muted" }, ` (${data.stored} stored)`)),
    h("button", { disabled: data.offset + data.items.length >= data.total, onclick: () => { state.offset += 50; renderEpisodes(); } }, "older ›"));
  const dead = h("details", { id: "dead-letters" }, h("summary", {}, "dead letters (refused records)"));
  dead.addEventListener("toggle", async () => {
    if (!dead.open || dead.dataset.loaded) return;
    dead.dataset.loaded = "1";
    const d = await api("/api/dead-letters?limit=50");
    dead.appendChild(d.items.length ? h("table", {}, h("tr", {}, ["time", "record", "field", "reason"].map((c) => h("th", {}, c))),
      d.items.map((x) => h("tr", {}, h("td", {}, fmtTime(x.created_at)), h("td", { class: "mono" }, x.record || ""),
        h("td", { class: "mono" }, x.field || ""), h("td", {}, x.reason)))) : h("p", { class: "muted" }, "none"));
  });
  state.indexing = data.indexing;
  const progress = data.indexing ? h("p", { class: data.indexing.error ? "err" : "muted", id: "indexing" },
    data.indexing.error ? `reading the store stopped: ${data.indexing.error}`
      : `reading the store: ${data.indexing.indexed} of ${data.indexing.total} episodes so far (the list fills in)`) : null;
  const bad = Math.max(data.unreadable.quarantined, data.unreadable.skipped);
  const banner = bad ? h("p", { class: "panel err", id: "unreadable", "data-count": bad },
    `${bad} stored episode(s) could not be read back and are not listed: they were moved to the dead letters ` +
    "(below; marft traces doctor checks a whole store)") : null;
  view.replaceChildren(h("h2", {}, "Episodes"), ...(progress ? [progress] : []), ...(banner ? [banner] : []),
    filterForm(data.choices),
    chips("per agent", data.counts.agents, "agent"), chips("per adapter version", data.counts.versions, "version"),
    chips("per source", data.counts.sources, "source"), table, pager, dead);
}

// Live: the store's change log is polled; the list re-reads its page when something changed.
async function poll() {
  const live = document.getElementById("live");
  try {
    if (state.cursor !== null) {
      const c = await api(`/api/changes?cursor=${state.cursor}`);
      if (c.cursor !== state.cursor) {
        state.cursor = c.cursor;
        for (const r of c.episodes) state.fresh.add(r.id);
        if (currentRoute().name === "episodes" && c.episodes.length) await renderEpisodes();
      } else if (currentRoute().name === "episodes" && state.indexing && !state.indexing.error) {
        await renderEpisodes();  // the store is still being read: show what arrived
      }
    }
    live.classList.remove("off");
    live.textContent = "live";
  } catch (e) {
    live.classList.add("off");
    live.textContent = "offline";
  }
}

// -- one episode ---------------------------------------------------------------------------------

function kv(rows) {
  return h("div", { class: "kv" }, rows.filter((r) => r[1] !== null && r[1] !== undefined && r[1] !== "")
    .map(([k, v]) => [h("div", {}, k), h("div", {}, v)]).flat());
}

function toolCall(c) {
  const fn = c.function || {};
  const name = fn.name || c.name || "?";
  let args = fn.arguments !== undefined ? fn.arguments : c.args !== undefined ? c.args : c.arguments;
  if (typeof args !== "string") args = JSON.stringify(args);
  return h("div", { class: "toolcall mono", "data-tool-call": name },
    "→ ", h("b", {}, name), `(${args || ""})`, c.id ? h("span", { class: "muted" }, `  id ${c.id}`) : null);
}

function message(m) {
  return h("div", { class: `msg role-${m.role}` },
    h("div", { class: "role" }, m.role, m.name ? ` · ${m.name}` : "", m.tool_call_id ? ` · result of ${m.tool_call_id}` : ""),
    m.content ? h("pre", {}, m.content) : null, (m.tool_calls || []).map(toolCall));
}

// Behaviour log-prob -> colour: green near 0 (likely), through yellow, to red at <= -6.
function lpColour(lp) {
  if (lp === null || lp === undefined) return "#eceef2";
  const t = Math.min(1, Math.max(0, -lp / 6));
  return `hsl(${Math.round(120 * (1 - t))}, 70%, ${82 - 10 * t}%)`;
}

function tokensBlock(rec, tokens) {
  const src = rec.token_source || "none";
  if (!tokens) {
    return h("div", { id: "tokens" }, h("p", { class: "muted" }, rec.kind === "llm"
      ? `token source: ${src} — no sampled token ids were recorded (the trainer re-tokenizes the text)`
      : `a ${rec.kind} step, not a model call: no tokens (not trained)`));
  }
  const shown = tokens.slice(0, 4000);
  return h("div", { id: "tokens", "data-token-source": src },
    h("p", { class: "muted" }, `token source: ${src} · ${tokens.length} tokens` +
      (tokens.length && tokens[0].text === undefined ? " (ids; marft ui --tokenizer DIR shows them as text)" : "") +
      " · colour = behaviour log-prob (green ≈ 0, red ≤ −6)" +
      (shown.length < tokens.length ? ` · first ${shown.length} shown` : "")),
    h("div", { class: "tokens" }, shown.map((t, i) => h("span", { class: "tok", style: `background:${lpColour(t.logprob)}`,
      title: `#${i} id ${t.id} log-prob ${t.logprob === null ? "?" : t.logprob.toFixed(4)}` },
      t.text === undefined ? String(t.id) : t.text.replace(/ /g, "·").replace(/\n/g, "↵") || "∅"))));
}

function duration(a, b) {
  if (!a || !b) return null;
  return `${((new Date(b) - new Date(a)) / 1000).toFixed(3)} s`;
}

async function showAction(epId, actionId, panel) {
  const d = await api(`/api/episodes/${encodeURIComponent(epId)}/actions/${encodeURIComponent(actionId)}`);
  const a = d.record;
  document.querySelectorAll("#graph .node.selected").forEach((n) => n.classList.remove("selected"));
  const node = document.querySelector(`#graph .node[data-action-id="${CSS.escape(a.id)}"]`);
  if (node) node.classList.add("selected");
  const link = (id) => h("a", { href: `#/episode/${encodeURIComponent(epId)}?action=${encodeURIComponent(id)}`, class: "mono",
    title: id }, `#${d.indexes[id]}`);
  const obs = a.observation || {};
  const tools = obs.tools || [];
  panel.replaceChildren(h("div", {},
    h("h3", {}, `Action #${d.index}: ${a.agent} · ${a.kind} · step ${a.step}`),
    kv([["id", h("span", { class: "mono" }, a.id)],
      ["policy", a.policy ? `${a.policy.name} v${a.policy.version ?? "?"}${a.policy.base_model ? ` on ${a.policy.base_model}` : ""}` : "—"],
      ["started", fmtTime(a.started_at)], ["ended", fmtTime(a.ended_at)], ["took", duration(a.started_at, a.ended_at)],
      ["depends on", a.depends_on.length ? h("span", {}, a.depends_on.map((x) => [link(x), " "]).flat()) : "—"],
      ["feeds", d.dependants.length ? h("span", {}, d.dependants.map((x) => [link(x), " "]).flat()) : "—"],
      ["error", a.error ? h("span", { class: "err" }, a.error) : null]]),
    h("h3", {}, "Observation"),
    h("div", { id: "observation" }, (obs.messages || []).map(message),
      obs.prompt ? h("pre", {}, obs.prompt) : null,
      !(obs.messages || []).length && !obs.prompt ? h("p", { class: "muted" }, "no messages recorded") : null),
    tools.length ? h("div", { id: "bound-tools" }, h("h3", {}, `Bound tools (${tools.length})`,
      obs.tool_choice ? h("span", { class: "muted" }, ` tool_choice ${JSON.stringify(obs.tool_choice)}`) : null),
      tools.map((t) => h("details", {}, h("summary", { class: "mono" }, (t.function || {}).name || "?",
        h("span", { class: "muted" }, " ", (t.function || {}).description || "")),
        h("pre", {}, json((t.function || {}).parameters || {}))))) : null,
    h("h3", {}, "Output"),
    h("div", { id: "output" }, a.output.text ? h("pre", {}, a.output.text) : null,
      (a.output.tool_calls || []).map(toolCall),
      a.output.finish_reason ? h("p", { class: "muted" }, `finish reason: ${a.output.finish_reason}`) : null),
    a.sampling ? h("div", {}, h("h3", {}, "Sampling"), kv(Object.entries(a.sampling).map(([k, v]) => [k, v === null ? null : JSON.stringify(v)]))) : null,
    h("h3", {}, "Tokens"), tokensBlock(a, d.tokens),
    h("h3", {}, "Rewards crediting this action"),
    d.rewards.length ? h("ul", {}, d.rewards.map((r) => h("li", {}, `${fmtNum(r.value)} · ${r.agent ? `agent ${r.agent}` : r.action_id ? "this action" : "team"} · ${r.source} · ${fmtTime(r.created_at)}`)))
      : h("p", { class: "muted" }, "none"),
    Object.keys(a.metadata || {}).length ? h("div", {}, h("h3", {}, "Metadata"), h("pre", {}, json(a.metadata))) : null,
    h("h3", {}, "Raw JSON ", h("button", { onclick: () => navigator.clipboard && navigator.clipboard.writeText(json(a)) }, "copy")),
    h("pre", { id: "raw-action" }, json(a))));
}

function actionTable(epId, page, onPick, reload) {
  return h("div", {},
    h("table", { id: "actions" }, h("thead", {}, h("tr", {}, ["#", "agent", "step", "kind", "policy", "depends on", "what"].map((c) => h("th", {}, c)))),
      h("tbody", {}, page.items.map((r) => h("tr", { class: "clickable", "data-action-id": r.id, onclick: () => onPick(r.id) },
        h("td", {}, r.index), h("td", {}, r.agent), h("td", {}, r.step), h("td", {}, r.kind), h("td", { class: "mono" }, r.policy || ""),
        h("td", { class: "mono" }, r.depends_on.map((x, i) => [i ? " " : "", actionRef(r.depends_on_index[i], x)]).flat()),
        h("td", { class: r.error ? "err" : "" }, r.label))))),
    h("div", { class: "pager" },
      h("button", { disabled: page.offset === 0, onclick: () => reload(Math.max(0, page.offset - page.limit)) }, "‹ prev"),
      h("span", {}, `${page.total ? page.offset + 1 : 0}–${page.offset + page.items.length} of ${page.total} actions`),
      h("button", { disabled: page.offset + page.items.length >= page.total, onclick: () => reload(page.offset + page.limit) }, "next ›")));
}

async function renderEpisode(id, actionId) {
  setNav("episodes");
  const e = await api(`/api/episodes/${encodeURIComponent(id)}`);
  const s = e.summary;
  const all = new Set(e.credited.flatMap((c) => c.actions));
  const detail = h("div", { class: "panel", id: "action-detail" }, h("p", { class: "muted" }, "click an action in the graph or the list"));
  const listBox = h("div", { id: "action-list" });
  const pick = (aid) => { history.replaceState(null, "", `#/episode/${encodeURIComponent(id)}?action=${encodeURIComponent(aid)}`); showAction(id, aid, detail).catch(showError); };
  let listFilter = {};
  const loadList = async (offset) => {
    const p = new URLSearchParams({ ...listFilter, offset, limit: 100 });
    listBox.replaceChildren(actionTable(id, await api(`/api/episodes/${encodeURIComponent(id)}/actions?${p}`), pick, loadList));
  };
  const graphBox = h("div", { class: "graph-wrap" });
  const draw = (credited) => graphBox.replaceChildren(drawGraph(e.graph, credited, (n) => {
    if (e.graph.collapsed) { listFilter = { agent: n.agent, step: n.step }; loadList(0); } else pick(n.id);
  }));
  draw(all);
  const rewards = e.credited.length ? h("table", { id: "rewards" },
    h("tr", {}, ["value", "for", "source", "time", "credits"].map((c) => h("th", {}, c))),
    e.credited.map((r) => h("tr", { class: "clickable", title: "highlight the path this reward credits", onclick: () => draw(new Set(r.actions)) },
      h("td", {}, fmtNum(r.value)), h("td", {}, r.action_id ? ["action ", actionRef(r.action_index, r.action_id)] : r.agent ? `agent ${r.agent}` : "team"),
      h("td", {}, r.source), h("td", {}, fmtTime(r.created_at)), h("td", {}, `${r.actions.length} actions`))))
    : h("p", { class: "muted" }, "no rewards");
  view.replaceChildren(
    h("h2", {}, "Episode ", h("span", { class: "mono" }, s.id)),
    h("div", { class: "panel" }, kv([["source", s.source], ["status", s.status], ["started", fmtTime(s.started_at)],
      ["ended", fmtTime(s.ended_at)], ["agents", s.agents.join(", ")], ["actions", `${s.n_actions} (${Object.entries(s.kinds).map(([k, n]) => `${n} ${k}`).join(", ")})`],
      ["adapter versions", s.versions.join(" ") || "—"], ["reward", fmtNum(s.reward)],
      ["capture errors", s.capture_errors || null],
      ["export", h("span", {}, h("a", { href: `/api/episodes/${encodeURIComponent(id)}/export`, id: "export-link" }, "episode JSON (download)"))]]),
      h("h3", {}, "Task"), h("pre", {}, typeof e.task === "string" ? e.task : json(e.task))),
    h("h3", {}, "Dependency graph D", h("span", { class: "muted" }, e.graph.collapsed
      ? ` — ${s.n_actions} actions, collapsed to one node per step and agent (click one to list its actions)`
      : " — agents as lanes, steps left to right, an arrow for each depends_on")),
    h("div", { class: "legend" }, ["llm", "tool", "message", "env"].map((k) => h("span", { class: `l-${k}` }, k)),
      h("span", { class: "l-credit" }, "on the path a reward credits (click a reward to show its own)")),
    h("div", { class: "cols" }, h("div", {}, graphBox, h("h3", {}, "Rewards"), rewards, h("h3", {}, "Actions"), listBox), detail));
  await loadList(0);
  if (actionId) await showAction(id, actionId, detail);
}

// -- training runs -------------------------------------------------------------------------------

async function renderRuns(name) {
  setNav("runs");
  const d = await api("/api/runs");
  const list = h("table", { id: "runs" }, h("tr", {}, ["run", "updates", "modified"].map((c) => h("th", {}, c))),
    d.runs.map((r) => h("tr", { class: "clickable" + (r.name === name ? " selected" : ""), "data-run": r.name,
      onclick: () => { location.hash = `#/runs/${encodeURIComponent(r.name)}`; } },
      h("td", { class: "mono" }, r.name), h("td", {}, r.updates), h("td", {}, new Date(r.modified * 1000).toISOString().slice(0, 19)))));
  const body = [h("h2", {}, "Training runs"),
    d.roots.length ? h("p", { class: "muted" }, `metrics.jsonl files under ${d.roots.join(", ")}`)
      : h("p", { class: "muted" }, "no --runs directories given"), list];
  if (name) {
    const r = await api(`/api/runs/${name.split("/").map(encodeURIComponent).join("/")}`);
    const keys = Object.keys(r.series);
    body.push(h("h3", {}, `${r.name}: ${r.updates} updates`, r.unreadable_lines ? h("span", { class: "err" }, ` (${r.unreadable_lines} unreadable lines skipped)`) : null),
      h("div", { class: "plots", id: "plots" }, keys.map((k) => linePlot(k, r.series[k]))));
  }
  view.replaceChildren(...body);
}

// -- adapters ------------------------------------------------------------------------------------

// Releases: per team release and per agent, live reward (95% always-valid interval, n) beside the
// gate score it was promoted on; a row is flagged "drift" when the live mean < gate − margin.
function liveCells(x) {
  const iv = x.interval ? `[${fmtNum(x.interval[0])}, ${fmtNum(x.interval[1])}]` : "–";
  return [h("td", {}, fmtNum(x.live_reward)), h("td", { class: "mono" }, iv), h("td", {}, x.n), h("td", {}, fmtNum(x.gate_score)),
    h("td", { class: x.drifted ? "err drift" : "" }, x.drifted ? "drift" : "")];
}

function releasesPanel(r) {
  if (r.error) return h("p", { class: "err" }, `releases: ${r.error}`);
  if (!r.releases.length) return null;
  const cols = ["release", "agent", "version", "live reward", "95% interval", "n", "gate score", ""];
  const rows = [];
  for (const rel of r.releases) {
    const tag = [rel.stable ? "stable" : null, rel.canary ? "canary" : null].filter(Boolean).join(", ");
    rows.push(h("tr", { "data-release": rel.release, class: rel.stable ? "selected" : "" },
      h("td", { class: rel.stable ? "current" : "" }, rel.release, tag ? ` (${tag})` : ""), h("td", {}, "team"), h("td", {}, ""), ...liveCells(rel)));
    for (const a of rel.agents) {
      rows.push(h("tr", { "data-release": rel.release, "data-agent": a.agent },
        h("td", {}, ""), h("td", {}, a.agent), h("td", {}, `v${a.version}`), ...liveCells(a)));
    }
  }
  return h("div", { class: "panel", id: "releases" }, h("h3", {}, "Releases ",
    h("span", { class: "muted" }, `live reward vs gate score · drift when live < gate − ${r.margin}`)),
  r.problems.map((p) => h("p", { class: "err" }, p)),
  h("table", {}, h("tr", {}, cols.map((c) => h("th", {}, c))), rows));
}

async function renderAdapters() {
  setNav("adapters");
  const [d, rel] = await Promise.all([api("/api/adapters"), api("/api/releases").catch((e) => ({ error: e.message }))]);
  const body = [h("h2", {}, "Adapters"), h("p", { class: "muted" }, d.registry ? `registry ${d.registry}` : "no registry given"),
    releasesPanel(rel)];
  for (const p of d.problems) body.push(h("p", { class: "err" }, p));
  for (const a of d.agents) {
    body.push(h("div", { class: "panel", "data-agent": a.agent }, h("h3", {}, a.agent, " ",
      h("span", { class: "muted" }, `current v${a.current ?? "–"} · promotions ${a.history.map((v) => `v${v}`).join(" → ") || "none"}`)),
    h("table", {}, h("tr", {}, ["version", "parent", "published", "metrics", "episodes served", "mean reward"].map((c) => h("th", {}, c))),
      a.versions.map((v) => h("tr", { "data-version": v.version, class: v.current ? "selected" : "" },
        h("td", { class: v.current ? "current" : "" }, `v${v.version}${v.current ? " (current)" : ""}`),
        h("td", {}, v.parent ? `v${v.parent}` : "–"), h("td", {}, fmtTime(v.created_at)),
        h("td", { class: "mono" }, Object.entries(v.metrics).map(([k, x]) => `${k}=${fmtNum(x)}`).join(" ")),
        h("td", { class: "served" }, v.served ? v.served.episodes : 0), h("td", {}, fmtNum(v.served ? v.served.mean_reward : null)))))));
  }
  const other = Object.entries(d.served_elsewhere);
  if (other.length) {
    body.push(h("h3", {}, "Versions seen in episodes but not in the registry"),
      h("table", {}, h("tr", {}, ["version", "episodes", "mean reward"].map((c) => h("th", {}, c))),
        other.map(([k, s]) => h("tr", {}, h("td", { class: "mono" }, k), h("td", {}, s.episodes), h("td", {}, fmtNum(s.mean_reward))))));
  }
  body.push(h("h3", {}, "Service decisions", d.service_state ? h("span", { class: "muted" }, ` (${d.service_state})`) : null));
  body.push(d.decisions.length ? h("table", { id: "decisions" }, h("tr", {}, ["time", "round", "decision", "reason", "details"].map((c) => h("th", {}, c))),
    d.decisions.map((x) => {
      const { time, round, decision, reason, ...rest } = x;
      return h("tr", {}, h("td", {}, fmtTime(time)), h("td", {}, round ?? ""), h("td", {}, decision), h("td", {}, reason || ""),
        h("td", { class: "mono" }, Object.keys(rest).length ? JSON.stringify(rest) : ""));
    })) : h("p", { class: "muted" }, d.service_state ? "no decisions yet" : "no --service-state given"));
  view.replaceChildren(...body.filter(Boolean));
}

// -- routing -------------------------------------------------------------------------------------

function currentRoute() {
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const q = new URLSearchParams(query || "");
  if (parts[0] === "episode" && parts[1]) return { name: "episode", id: parts[1], action: q.get("action") };
  if (parts[0] === "runs") return { name: "runs", run: parts.slice(1).join("/") || null };
  if (parts[0] === "adapters") return { name: "adapters" };
  return { name: "episodes" };
}

async function route() {
  const r = currentRoute();
  try {
    if (r.name === "episode") await renderEpisode(r.id, r.action);
    else if (r.name === "runs") await renderRuns(r.run);
    else if (r.name === "adapters") await renderAdapters();
    else await renderEpisodes();
    document.body.dataset.ready = r.name;
  } catch (e) {
    showError(e);
    document.body.dataset.ready = "error";
  }
}

window.addEventListener("hashchange", () => { document.body.dataset.ready = ""; route(); });
api("/api/meta").then((m) => { document.getElementById("store-url").textContent = m.store; state.cursor ??= m.cursor; }).catch(() => {});
route();
setInterval(poll, 1500);
