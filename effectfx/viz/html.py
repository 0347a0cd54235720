"""A self-contained HTML page drawing a program's graphs (``effectfx show --html``).

graph -> JSON description (:mod:`effectfx.viz.graph_json`) -> this template.  The page needs no network:
CSS, JS and the data are inline, and the token lanes are inline SVG drawn by the script.  What it shows:

* every graph as a column of nodes in program order (inputs, ops, effects, region calls, outputs);
* each region call as a box (``<details>``) that opens to show its subgraph, nested to any depth;
* effect nodes labelled with their op and arguments, tinted with their key's color;
* per effect key, a colored lane to the left of each graph joining the nodes of that key's token chain
  (solid: tokens thread it; dashed: only node order keeps it, as in the captured and token-free forms);
  clicking a key in the legend highlights its chain everywhere and dims the rest.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from .graph_json import program_json

_CSS = r"""
:root { --fg:#1d1d1f; --muted:#6e6e73; --line:#d2d2d7; --bg:#fbfbfd; }
* { box-sizing: border-box; }
body { font: 14px/1.4 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: var(--fg);
       background: var(--bg); margin: 0; padding: 16px 24px 48px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 24px 0 6px; }
.efx-sub { color: var(--muted); margin-bottom: 8px; }
.efx-legend { display: flex; gap: 8px; flex-wrap: wrap; align-items: center; margin: 8px 0 4px; }
.efx-key { border: 2px solid currentColor; border-radius: 12px; padding: 1px 10px; cursor: pointer;
           background: #fff; font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
.efx-key.efx-active { color: #fff !important; }
button.efx-btn { font-size: 12px; padding: 2px 8px; cursor: pointer; }
.efx-history { color: var(--muted); font-size: 12px; }
.efx-graph { position: relative; border: 1px solid var(--line); border-radius: 6px; background: #fff;
             margin: 4px 0; padding: 4px 6px 4px 0; }
.efx-graph-head { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px;
                  color: var(--muted); padding: 2px 0 2px 8px; }
.efx-body { position: relative; }
.efx-lanes { position: absolute; left: 0; top: 0; overflow: visible; pointer-events: none; }
.efx-nodes { list-style: none; margin: 0; padding: 0; }
.efx-node { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12.5px; padding: 1px 6px;
            margin: 1px 0; border-left: 3px solid transparent; white-space: pre-wrap; word-break: break-all; }
.efx-node[data-kind="input"], .efx-node[data-kind="output"] { color: var(--muted); }
.efx-node[data-kind="getitem"] { color: #8e8e93; }
.efx-node[data-kind="token"] { color: #8e8e93; font-style: italic; }
.efx-node[data-kind="effect"] { font-weight: 600; border-radius: 3px; }
.efx-node[data-kind="region"] { padding: 0 0 0 2px; }
.efx-badge { display: inline-block; font-size: 10.5px; font-weight: 600; border-radius: 8px; padding: 0 6px;
             margin: 0 4px; color: #fff; font-style: normal; vertical-align: 1px; }
details.efx-region { border: 1.5px solid #8e8e93; border-radius: 6px; background: #f5f5f7; margin: 2px 0; }
details.efx-region > summary { cursor: pointer; padding: 3px 6px; font-family: -apple-system, "Segoe UI",
             Helvetica, Arial, sans-serif; font-size: 13px; }
details.efx-region[open] > summary { border-bottom: 1px solid var(--line); }
.efx-region-body { padding: 4px 6px 6px 10px; }
.efx-region-name { font-weight: 600; }
.efx-internal { color: var(--muted); font-size: 11px; margin-left: 10px; }
.efx-muted { color: var(--muted); }
.efx-dim { opacity: 0.25; }
details.efx-code pre { background: #fff; border: 1px solid var(--line); padding: 8px; overflow: auto;
                       font-size: 12px; }
"""

_JS = r"""
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("efx-data").textContent);
  var LANE = 12, BUDGET = 4000, rendered = 0;
  var app = document.getElementById("efx-app");
  var focusKey = null;

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }
  function color(key) { return data.colors[key] || "#888"; }
  function badge(key) {
    var b = el("span", "efx-badge", key);
    b.style.background = color(key);
    b.setAttribute("data-key", key);
    return b;
  }
  function graphKeys(g) { return Object.keys(g.chains).sort(); }

  function renderNode(g, n, depth) {
    var li = el("li", "efx-node");
    li.setAttribute("data-kind", n.kind);
    li.setAttribute("data-name", n.name);
    if (n.key) li.setAttribute("data-key", n.key);
    li.setAttribute("data-keys", (n.tokens || []).concat(n.key ? [n.key] : []).join(" "));
    if (n.kind === "region") {
      var sub = data.graphs[n.subgraph];
      var det = el("details", "efx-region");
      det.setAttribute("data-identifier", n.identifier || "");
      det.setAttribute("data-subgraph", n.subgraph || "");
      var sum = el("summary");
      // the user's name first; effectfx's own names for the body and its graph come last, in small type
      sum.appendChild(el("span", "efx-region-name", "region " + (n.region || sub.region || sub.attr) +
                         (sub.direction === "backward" ? " (backward)" : "")));
      sum.appendChild(el("span", "efx-muted", "  " + sub.nodes.length + " nodes \u00b7 "));
      if (n.key) sum.appendChild(badge(n.key));
      var effects = sub.effects || [];
      if (effects.length) {
        sum.appendChild(el("span", "efx-muted", "effects:"));
        effects.forEach(function (k) { sum.appendChild(badge(k)); });
      } else if (!sub.effects_known && (sub.effects_inside || []).length) {
        sum.appendChild(el("span", "efx-muted", "effects inside:"));
        sub.effects_inside.forEach(function (k) { sum.appendChild(badge(k)); });
      } else {
        sum.appendChild(el("span", "efx-muted", "no effects"));
      }
      sum.appendChild(el("span", "efx-internal", "body " + (n.identifier || "?") + ", graph " + sub.attr));
      sum.appendChild(el("div", "efx-muted", n.text));
      det.appendChild(sum);
      var body = el("div", "efx-region-body");
      det.appendChild(body);
      var fill = function () {
        if (!body.firstChild) body.appendChild(renderGraph(sub, depth + 1));
      };
      if (rendered < BUDGET && depth < 12) fill();
      det.addEventListener("toggle", function () { fill(); drawAllLanes(); });
      li.appendChild(det);
      return li;
    }
    if (n.kind === "effect") {
      li.style.borderLeftColor = color(n.key);
      li.style.background = color(n.key) + "14";
      li.appendChild(badge(n.key || "?"));
      li.appendChild(el("span", "efx-effect-label", n.text));
      li.title = "effect on key '" + n.key + "': " + n.text;
      return li;
    }
    li.textContent = n.text;
    if (n.kind === "token" && n.key) {
      li.appendChild(badge(n.key));
      li.style.borderLeftColor = color(n.key);
    }
    return li;
  }

  function renderGraph(g, depth) {
    var box = el("div", "efx-graph");
    box.setAttribute("data-graph", g.id);
    if (g.signature) box.appendChild(el("div", "efx-graph-head", g.signature));
    var body = el("div", "efx-body");
    var keys = graphKeys(g);
    var gutter = keys.length * LANE + (keys.length ? 6 : 0);
    var svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("class", "efx-lanes");
    svg.setAttribute("width", String(gutter));
    body.appendChild(svg);
    var ol = el("ol", "efx-nodes");
    ol.style.marginLeft = (gutter + 4) + "px";
    g.nodes.forEach(function (n) { ol.appendChild(renderNode(g, n, depth)); rendered += 1; });
    body.appendChild(ol);
    box.appendChild(body);
    box._efx = { graph: g, svg: svg, ol: ol, keys: keys, body: body };
    return box;
  }

  function drawLanes(box) {
    var info = box._efx, svg = info.svg;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var height = info.body.offsetHeight;
    svg.setAttribute("height", String(height));
    if (!height) return;
    var rows = {};
    Array.prototype.forEach.call(info.ol.children, function (li) {
      rows[li.getAttribute("data-name")] = li;
    });
    var top = info.body.getBoundingClientRect().top;
    info.keys.forEach(function (key, lane) {
      var chain = info.graph.chains[key];
      var ys = [];
      chain.nodes.forEach(function (name) {
        var li = rows[name];
        if (!li) return;
        var r = li.getBoundingClientRect();
        var h = li.getAttribute("data-kind") === "region" ? Math.min(r.height, 22) : r.height;
        ys.push(r.top - top + h / 2);
      });
      if (!ys.length) return;
      var x = 6 + lane * LANE;
      var ns = "http://www.w3.org/2000/svg";
      var g = document.createElementNS(ns, "g");
      g.setAttribute("class", "efx-chain");
      g.setAttribute("data-key", key);
      if (focusKey && focusKey !== key) g.setAttribute("opacity", "0.2");
      var line = document.createElementNS(ns, "line");
      line.setAttribute("x1", x); line.setAttribute("x2", x);
      line.setAttribute("y1", ys[0]); line.setAttribute("y2", ys[ys.length - 1]);
      line.setAttribute("stroke", color(key)); line.setAttribute("stroke-width", "3");
      if (chain.style === "order") line.setAttribute("stroke-dasharray", "4 3");
      g.appendChild(line);
      ys.forEach(function (y) {
        var c = document.createElementNS(ns, "circle");
        c.setAttribute("cx", x); c.setAttribute("cy", y); c.setAttribute("r", "4");
        c.setAttribute("fill", chain.style === "order" ? "#fff" : color(key));
        c.setAttribute("stroke", color(key)); c.setAttribute("stroke-width", "2");
        g.appendChild(c);
      });
      var t = document.createElementNS(ns, "title");
      t.textContent = "effect key '" + key + "' (" +
        (chain.style === "token" ? "token chain" : "node order") + ")";
      g.appendChild(t);
      svg.appendChild(g);
    });
  }

  function drawAllLanes() {
    Array.prototype.forEach.call(document.querySelectorAll(".efx-graph"), function (box) {
      if (box._efx) drawLanes(box);
    });
  }

  function applyFocus() {
    Array.prototype.forEach.call(document.querySelectorAll(".efx-node"), function (li) {
      var keys = (li.getAttribute("data-keys") || "").split(" ");
      var dim = focusKey !== null && keys.indexOf(focusKey) < 0 && li.getAttribute("data-kind") !== "region";
      li.classList.toggle("efx-dim", dim);
    });
    Array.prototype.forEach.call(document.querySelectorAll(".efx-legend .efx-key"), function (b) {
      var on = b.getAttribute("data-key") === focusKey;
      b.classList.toggle("efx-active", on);
      b.style.background = on ? color(focusKey) : "#fff";
    });
    drawAllLanes();
  }

  // header
  app.appendChild(el("h1", null, "effectfx \u00b7 " + data.title));
  var nPrograms = data.programs.length, nGraphs = Object.keys(data.graphs).length;
  app.appendChild(el("div", "efx-sub", data.form + " form \u00b7 " + nPrograms +
                     (nPrograms === 1 ? " program" : " programs") + " \u00b7 " + nGraphs +
                     (nGraphs === 1 ? " graph" : " graphs")));
  var legend = el("div", "efx-legend");
  legend.appendChild(el("span", "efx-muted", data.keys.length ? "effect keys:" : "no effect keys"));
  data.keys.forEach(function (key) {
    var b = el("span", "efx-key", key);
    b.style.color = color(key);
    b.setAttribute("data-key", key);
    b.addEventListener("click", function () { focusKey = focusKey === key ? null : key; applyFocus(); });
    legend.appendChild(b);
  });
  var expand = el("button", "efx-btn", "open all regions");
  expand.addEventListener("click", function () {
    var all = document.querySelectorAll("details.efx-region");
    var open = Array.prototype.some.call(all, function (d) { return !d.open; });
    Array.prototype.forEach.call(all, function (d) { d.open = open; });
    expand.textContent = open ? "close all regions" : "open all regions";
    drawAllLanes();
  });
  legend.appendChild(expand);
  app.appendChild(legend);

  data.programs.forEach(function (p) {
    var sec = el("section", "efx-program");
    sec.setAttribute("data-program", p.name);
    sec.appendChild(el("h2", null, p.name));
    var hist = p.history.map(function (h) { return h[0] + " (" + (h[1] * 1000).toFixed(1) + " ms)"; });
    sec.appendChild(el("div", "efx-history", p.form + " form; made by: " + (hist.join(" \u2192 ") || "-") +
                       (p.token_keys.length ? "; tokens: " + p.token_keys.join(", ") : "")));
    sec.appendChild(renderGraph(data.graphs[p.root], 0));
    var code = el("details", "efx-code");
    code.appendChild(el("summary", null, "code"));
    code.appendChild(el("pre", null, p.code));
    sec.appendChild(code);
    app.appendChild(sec);
  });
  if (location.hash === "#open") {
    Array.prototype.forEach.call(document.querySelectorAll("details.efx-region"), function (d) {
      d.open = true;
    });
  }
  drawAllLanes();
  window.addEventListener("resize", drawAllLanes);
  document.body.setAttribute("data-efx-rendered", String(rendered));
})();
"""

_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<div id="efx-app"></div>
<noscript>This page draws the graphs with JavaScript; the code of every graph follows.
<pre>{code}</pre></noscript>
<script type="application/json" id="efx-data">{data}</script>
<script>{js}</script>
</body>
</html>
"""


def _script_json(data: Any) -> str:
    # Inside <script>, only "</" (and "<!--") could end or confuse the element: escape every "<".
    return json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")


def render_html(data: dict[str, Any]) -> str:
    """The page for a description made by :func:`effectfx.viz.graph_json.program_json`."""
    code = "\n\n".join(p["code"] for p in data["programs"])
    return _TEMPLATE.format(title=html.escape(f"effectfx · {data['title']}"), css=_CSS, js=_JS,
                            data=_script_json(data), code=html.escape(code))


def program_html(prog: Any, title: str | None = None) -> str:
    """The HTML page of a Program or TrainingProgram."""
    return render_html(program_json(prog, title))


def write_html(prog: Any, path: str | Path, title: str | None = None) -> Path:
    path = Path(path)
    path.write_text(program_html(prog, title), encoding="utf-8")
    return path
