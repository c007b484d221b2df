"use strict";
// The shadow dashboard: one card per candidate, rebuilt from each summary
// the server sends on /shadow/events (one JSON summary per event; an
// event named "remove" drops a candidate).
(function () {
  const summaries = new Map();
  const main = document.getElementById("candidates");
  const empty = document.getElementById("empty");
  const status = document.getElementById("status");
  const statusText = document.getElementById("status-text");
  const SVG = "http://www.w3.org/2000/svg";

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    for (const c of children) e.append(c);
    return e;
  }
  function svg(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    return e;
  }
  const fmt = (n) => Number(n || 0).toLocaleString("en-US");
  const pct = (a, b) => (b > 0 ? (100 * a / b).toFixed(1) + "%" : "–");
  const when = (us) => (us ? new Date(us / 1000).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC") : "–");
  const clock = (us) => new Date(us / 1000).toISOString().slice(11, 19);

  function stat(field, label, value, extra, cls) {
    const v = el("div", { class: "value", "data-field": field }, fmt(value));
    const box = el("div", { class: "stat " + (cls || "") }, el("div", { class: "label" }, label), v);
    if (extra !== undefined) box.append(el("div", { class: "pct", "data-field": field + "_pct" }, extra));
    return box;
  }

  function chart(s) {
    const pts = s.series || [];
    const wrap = el("div", { class: "chart" }, el("h3", {}, "Deny rate over time"));
    if (!pts.some((p) => p.evaluated > 0)) {
      wrap.append(el("div", { class: "nodata" }, "no records yet"));
      return wrap;
    }
    const W = 560, H = 190, L = 34, R = 8, T = 8, B = 22;
    const iw = W - L - R, ih = H - T - B;
    const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img",
      "aria-label": "would-deny rate and live deny rate" });
    for (const f of [0, 0.25, 0.5, 0.75, 1]) {
      const y = T + ih * (1 - f);
      g.append(svg("line", { class: "grid-line", x1: L, x2: W - R, y1: y, y2: y }));
      const t = svg("text", { class: "axis", x: L - 5, y: y + 3, "text-anchor": "end" });
      t.textContent = Math.round(f * 100) + "%";
      g.append(t);
    }
    const n = pts.length;
    const x = (i) => L + (n === 1 ? iw / 2 : (iw * i) / (n - 1));
    const y = (r) => T + ih * (1 - r);
    const line = (key) => pts
      .map((p, i) => [i, p.evaluated > 0 ? p[key] / p.evaluated : null])
      .filter(([, r]) => r !== null)
      .map(([i, r]) => `${x(i).toFixed(1)},${y(r).toFixed(1)}`);
    const cand = line("would_deny"), live = line("live_denied");
    if (cand.length > 1) {
      const first = cand[0].split(",")[0], last = cand[cand.length - 1].split(",")[0];
      g.append(svg("polygon", { class: "cand-area", points: `${first},${y(0)} ${cand.join(" ")} ${last},${y(0)}` }));
    }
    g.append(svg("polyline", { class: "live-line", points: live.join(" "), "data-series": "live" }));
    g.append(svg("polyline", { class: "cand-line", points: cand.join(" "), "data-series": "candidate" }));
    if (n === 1) {
      for (const [k, c] of [["would_deny", "cand-line"], ["live_denied", "live-line"]]) {
        const p = pts[0];
        g.append(svg("circle", { cx: x(0), cy: y(p[k] / p.evaluated), r: 3, class: c }));
      }
    }
    for (const [i, anchor] of [[0, "start"], [n - 1, "end"]]) {
      const t = svg("text", { class: "axis", x: x(i), y: H - 6, "text-anchor": n === 1 ? "middle" : anchor });
      t.textContent = clock(pts[i].t_us);
      g.append(t);
      if (n === 1) break;
    }
    wrap.append(g, el("div", { class: "legend" },
      el("span", {}, el("span", { class: "sw cand" }), "candidate would deny"),
      el("span", {}, el("span", { class: "sw live" }), "live denied")));
    return wrap;
  }

  const SHOWN = 8; // top keys shown before "more"

  function keyTable(rows, max) {
    const body = el("tbody");
    for (const k of rows) {
      const bar = el("div", { class: "barfill" });
      bar.style.width = (100 * k.would_deny / max).toFixed(1) + "%"; // CSSOM: allowed by the page's CSP
      body.append(el("tr", { "data-key": k.key },
        el("td", { class: "key" }, k.key),
        el("td", { class: "num", "data-field": "key_would_deny" }, fmt(k.would_deny)),
        el("td", { class: "bar" }, bar)));
    }
    return el("table", {}, el("colgroup", {}, el("col", { class: "c-key" }), el("col", { class: "c-num" }), el("col", { class: "c-bar" })), body);
  }

  function keys(s) {
    const top = s.top_denied || [];
    const box = el("div", { class: "keys" }, el("h3", {}, "Top denied keys"));
    if (top.length === 0) {
      box.append(el("div", { class: "none" }, "none denied"));
      return box;
    }
    const max = top[0].would_deny || 1;
    box.append(el("div", { class: "thead" }, el("span", {}, "key"), el("span", {}, "would deny")));
    box.append(keyTable(top.slice(0, SHOWN), max));
    if (top.length > SHOWN) {
      const more = el("details", {}, el("summary", {}, `${top.length - SHOWN} more`), keyTable(top.slice(SHOWN), max));
      box.append(more);
    }
    return box;
  }

  function card(s) {
    const ev = s.evaluated || 0;
    const stats = el("div", { class: "stats" },
      stat("evaluated", "evaluated", ev),
      stat("would_allow", "would allow", s.would_allow, pct(s.would_allow, ev)),
      stat("would_deny", "would deny", s.would_deny, pct(s.would_deny, ev), "cand"),
      stat("live_denied", "live denied", s.live_denied, pct(s.live_denied, ev), "live"),
      stat("both_denied", "both denied", s.both_denied, undefined, "small"),
      stat("would_deny_units", "units would deny", s.would_deny_units, undefined, "small"),
      stat("only_candidate_denied", "only candidate", s.only_candidate_denied, undefined, "small cand"),
      stat("only_live_denied", "only live", s.only_live_denied, undefined, "small live"),
      stat("keys", "keys", s.keys, undefined, "small"));
    const extra = [];
    if (s.skipped) extra.push(fmt(s.skipped) + " skipped (no key dimension)");
    if (s.overflow) extra.push(fmt(s.overflow) + " over the key cap");
    const meta = el("div", { class: "meta" },
      `since ${when(s.since_us)} · last record ${when(s.last_us)}` + (extra.length ? " · " + extra.join(" · ") : ""));
    return el("section", { class: "candidate", "data-policy": s.policy, "data-revision": String(s.revision) },
      el("h2", {}, el("span", { class: "name" }, s.policy), el("span", { class: "rev", "data-field": "revision" }, "revision " + s.revision)),
      meta,
      el("div", { class: "grid" }, stats, chart(s)),
      keys(s));
  }

  function render(name) {
    const old = main.querySelector(`section.candidate[data-policy="${CSS.escape(name)}"]`);
    const s = summaries.get(name);
    if (!s) {
      if (old) old.remove();
    } else {
      const fresh = card(s);
      if (old) {
        old.replaceWith(fresh);
      } else {
        const after = [...main.querySelectorAll("section.candidate")].find((c) => c.dataset.policy > name);
        main.insertBefore(fresh, after || null);
      }
    }
    empty.hidden = summaries.size > 0;
  }

  function setStatus(state, text) {
    status.dataset.state = state;
    statusText.textContent = text;
  }

  const url = location.pathname.replace(/\/?$/, "/events");
  const es = new EventSource(url);
  es.onopen = () => setStatus("live", "live");
  es.onerror = () => setStatus("reconnecting", "reconnecting…");
  es.onmessage = (m) => {
    let s;
    try { s = JSON.parse(m.data); } catch (e) { return; }
    if (!s || typeof s.policy !== "string") return;
    summaries.set(s.policy, s);
    render(s.policy);
  };
  es.addEventListener("remove", (m) => {
    try {
      const { policy } = JSON.parse(m.data);
      summaries.delete(policy);
      render(policy);
    } catch (e) { /* ignore */ }
  });
})();
