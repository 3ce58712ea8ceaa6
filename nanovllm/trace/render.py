"""A step trace (nanovllm/core/step_trace.py) as one self-contained HTML page: inline SVG drawn
here, inline CSS, a few lines of inline script (a time cursor shared by the charts); nothing
is fetched, so the page opens offline and can be mailed around.

The page: the run's totals and engine config; then, over wall time, tokens per step, the
waiting and running queues, and KV blocks by tier; then one Gantt lane per sequence. What they
show (time buckets past MAX_POINTS steps, lanes) is worked out in figures.py.
"""

import html
import json
import math
import time
from collections import Counter

from nanovllm.trace.figures import KV_FIELDS, Point, lanes, points, totals

WIDTH, LEFT, RIGHT = 1240, 130, 20  # SVG units; the time axis runs from LEFT to WIDTH - RIGHT
PLOT = WIDTH - LEFT - RIGHT
REASON_CLASSES = ("stop", "length", "abort")  # other finish reasons are drawn grey


# ---------------------------------------------------------------- drawing

def _n(v: float) -> str:
    """A coordinate, short: one decimal, no trailing zeros."""
    return f"{v:.1f}".rstrip("0").rstrip(".")


def _e(v: object) -> str:
    return html.escape(str(v), quote=True)


def _s(t: float) -> str:
    """Seconds, for people."""
    return f"{t * 1000:.1f} ms" if t < 1 else f"{t:.3f} s"


def _top(v: float) -> float:
    """A round number at or above v, the top of a y axis."""
    if v <= 0:
        return 1
    mag = 10 ** math.floor(math.log10(v))
    return next(m * mag for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if m * mag >= v)


def _nice(hi: float, n: int) -> list[float]:
    """Round ticks from 0 to hi, about n of them."""
    if hi <= 0:
        return [0.0]
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [round(i * step, 9) for i in range(int(hi / step + 1e-9) + 1)]


class Axis:
    """Wall time to SVG x."""

    def __init__(self, wall: float) -> None:
        self.wall = wall

    def x(self, t: float) -> float:
        return LEFT + t / self.wall * PLOT

    def grid(self, top: float, bottom: float, labels_at: float | None) -> str:
        out = []
        for v in _nice(self.wall, 10):
            x = _n(self.x(v))
            out.append(f'<line class="grid" x1="{x}" x2="{x}" y1="{_n(top)}" y2="{_n(bottom)}"/>')
            if labels_at is not None:
                out.append(f'<text class="tick" x="{x}" y="{_n(labels_at)}" '
                           f'text-anchor="middle">{v:g} s</text>')
        return "".join(out)


def _svg(height: float, wall: float, body: str, cls: str) -> str:
    return (f'<svg class="{cls}" viewBox="0 0 {WIDTH} {_n(height)}" width="{WIDTH}" '
            f'data-x0="{LEFT}" data-x1="{WIDTH - RIGHT}" data-wall="{wall}">{body}</svg>')


def _panel_frame(y: float, h: float, title: str, ymax: float, unit: str) -> str:
    return (f'<text class="ptitle" x="{LEFT}" y="{_n(y - 6)}">{_e(title)}</text>'
            f'<line class="axis" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{_n(y + h)}" '
            f'y2="{_n(y + h)}"/><text class="tick" x="{LEFT - 6}" y="{_n(y + 4)}" '
            f'text-anchor="end">{ymax:g} {unit}</text><text class="tick" x="{LEFT - 6}" '
            f'y="{_n(y + h)}" text-anchor="end">0</text>')


def _area(xs: list[float], lo: list[float], hi: list[float], cls: str) -> str:
    """A band between two lines, as one polygon."""
    pts = [f"{_n(x)},{_n(y)}" for x, y in zip(xs, hi)]
    pts += [f"{_n(x)},{_n(y)}" for x, y in zip(reversed(xs), reversed(lo))]
    return f'<polygon class="{cls}" points="{" ".join(pts)}"/>'


def _hover_title(p: Point, host: bool) -> str:
    first, last = p.steps[0]["step"], p.steps[-1]["step"]
    ev = {k: sum(len(s[k]) for s in p.steps) for k in ("arrived", "preempted", "finished")}
    lines = [f"step {first}: {_s(p.t0)}, took {_s(p.t1 - p.t0)}" if first == last else
             f"steps {first}–{last} ({len(p.steps)}): {_s(p.t0)} – {_s(p.t1)}",
             f"tokens/step: prefill {p.prefill:.4g}, decode {p.decode:.4g}",
             f"waiting {p.waiting}, running {p.running}"]
    lines += [f"{tier} KV: " + ", ".join(f"{f} {p.kv[tier][f]:.0f}" for f in KV_FIELDS)
              for tier in ("device", "host")[:1 + host]]
    lines.append(", ".join(f"{k} {v}" for k, v in ev.items() if v))
    return _e("\n".join(lines).strip())


def timeline(header: dict, steps: list[dict], axis: Axis) -> str:
    """One SVG, four panels over wall time: tokens per step, queues, device KV, host KV."""
    pts = points(steps, axis.wall)
    host = bool(header.get("num_host_blocks"))
    xs = [axis.x((p.t0 + p.t1) / 2) for p in pts]
    out, y, gap = [], 24.0, 34.0
    # tokens per step: decode at the bottom, prefill above it (a mixed step shows both)
    h = 170.0
    ymax = _top(max(p.prefill + p.decode for p in pts))
    out.append(_panel_frame(y, h, "tokens per step", ymax, "tok"))
    for kind, base in (("decode", lambda p: 0.0), ("prefill", lambda p: p.decode)):
        d = []
        for p in pts:
            v, b = getattr(p, kind), base(p)
            if v > 0:
                x0, w = axis.x(p.t0), max(axis.x(p.t1) - axis.x(p.t0), 0.6)
                d.append(f"M{_n(x0)},{_n(y + h - b / ymax * h)}h{_n(w)}v{_n(-v / ymax * h)}"
                         f"h{_n(-w)}z")
        out.append(f'<path class="{kind}" d="{"".join(d)}"/>')
    y += h + gap
    # queues: the most waiting and running in each bucket
    h = 110.0
    qmax = _top(max(max(p.waiting, p.running) for p in pts))
    out.append(_panel_frame(y, h, "queues: waiting and running sequences", qmax, "seq"))
    for kind in ("waiting", "running"):
        line = " ".join(f"{_n(x)},{_n(y + h - getattr(p, kind) / qmax * h)}"
                        for x, p in zip(xs, pts))
        out.append(f'<polyline class="q-{kind}" points="{line}"/>')
    y += h + gap
    # KV blocks by tier, stacked: used, cached, free
    for tier, total in (("device", header.get("num_kv_blocks")),
                        ("host", header.get("num_host_blocks"))):
        if tier == "host" and not host:
            continue
        top = max(sum(p.kv[tier].values()) for p in pts)
        total = max(total or 0, top) or 1
        out.append(_panel_frame(y, h, f"KV cache, {tier} tier (blocks)", total, "blk"))
        lo = [0.0] * len(pts)
        for f in KV_FIELDS:
            hi = [b + p.kv[tier][f] for b, p in zip(lo, pts)]
            out.append(_area(xs, [y + h - v / total * h for v in lo],
                             [y + h - v / total * h for v in hi], f"kv-{f}"))
            lo = hi
        y += h + gap
    bottom = y - gap
    grid = axis.grid(24, bottom, bottom + 16)
    hover = []  # one column per bucket, to the next bucket's start: its figures on hover
    for i, p in enumerate(pts):
        x0 = axis.x(p.t0)
        x1 = axis.x(pts[i + 1].t0) if i + 1 < len(pts) else axis.x(p.t1)
        hover.append(f'<rect class="hov" x="{_n(x0)}" y="24" width="{_n(max(x1 - x0, 0.5))}" '
                     f'height="{_n(bottom - 24)}"><title>{_hover_title(p, host)}</title></rect>')
    return _svg(bottom + 24, axis.wall, grid + "".join(out) + "".join(hover), "timeline")


def gantt(steps: list[dict], axis: Axis) -> str:
    """One lane per sequence: queued, prefill chunks, decode runs; preemptions ▼, finish ●."""
    all_lanes = lanes(steps, pixel=axis.wall / PLOT)
    lh = max(3.0, min(16.0, 1200 / max(len(all_lanes), 1)))  # lane height
    bar, top = lh * 0.7, 30.0
    out = [axis.grid(top - 4, top + lh * len(all_lanes), 16)]
    x = axis.x
    for i, ln in enumerate(all_lanes):
        y = top + i * lh
        yb = y + (lh - bar) / 2
        pre = Counter(k for _, k, _ in ln.preempted)
        end, reason, n_out = ln.finished or (0.0, "", 0)
        about = [f"{ln.req} (sequence {ln.seq})",
                 ln.arrived is not None and f"arrived {_s(ln.arrived)}, prompt {ln.prompt} tokens",
                 pre and "preempted " + ", ".join(f"{v}× {k}" for k, v in pre.items()),
                 ln.finished and f"finished {_s(end)}: {reason}, {n_out} output tokens"]
        about = _e("\n".join(a for a in about if a))
        g = [f'<g class="lane" data-req="{_e(ln.req)}"><title>{about}</title>',
             f'<rect class="{"band" if i % 2 else "band2"}" x="{LEFT}" y="{_n(y)}" '
             f'width="{PLOT}" height="{_n(lh)}"/>']
        if lh >= 9:
            g.append(f'<text class="label" x="{LEFT - 6}" y="{_n(y + lh * 0.75)}" '
                     f'text-anchor="end">{_e(ln.req[:18])}</text>')
        for sg in ln.segments:
            if sg.kind == "queued":
                what = f"queued {_s(sg.t1 - sg.t0)}"
            else:
                where = f"step {sg.first}" if sg.first == sg.last else \
                    f"steps {sg.first}–{sg.last}"
                what = (f"{sg.kind} tokens {sg.tok0}–{sg.tok1} of {sg.total}, {where}, "
                        f"{_s(sg.t1 - sg.t0)}")
            g.append(f'<rect class="{sg.kind}" x="{_n(x(sg.t0))}" y="{_n(yb)}" '
                     f'width="{_n(max(x(sg.t1) - x(sg.t0), 0.5))}" height="{_n(bar)}">'
                     f'<title>{_e(ln.req)}: {_e(what)}</title></rect>')
        for t, kind, step in ln.preempted:
            g.append(f'<path class="pm pm-{_e(kind)}" d="M{_n(x(t) - lh * .4)},{_n(y)}'
                     f'h{_n(lh * .8)}l{_n(-lh * .4)},{_n(lh * .9)}z"><title>{_e(ln.req)}: '
                     f'preempted ({_e(kind)}) at step {step}, {_s(t)}</title></path>')
        if ln.finished:
            cls = reason if reason in REASON_CLASSES else "other"
            g.append(f'<circle class="fin fin-{cls}" cx="{_n(x(end))}" cy="{_n(y + lh / 2)}" '
                     f'r="{_n(max(1.5, lh * .35))}"><title>{_e(ln.req)}: finished ({_e(reason)})'
                     f', {n_out} output tokens, {_s(end)}</title></circle>')
        out.append("".join(g) + "</g>")
    return _svg(top + lh * len(all_lanes) + 8, axis.wall, "".join(out), "gantt")


# ---------------------------------------------------------------- the page

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:20px 28px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:26px 0 6px}.sub{color:#666}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card b{display:block;font-size:18px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:150px}
.card span,.empty{color:#666;font-size:12px}details{margin-top:12px}table{border-collapse:collapse}
td{border-bottom:1px solid #eee;padding:2px 12px 2px 0;font:12px monospace}
.legend{font-size:12px;color:#444;margin:4px 0}
.legend i{display:inline-block;width:11px;height:11px;margin:0 4px -1px 12px;border-radius:2px}
svg{background:#fff;border:1px solid #ddd;max-width:100%;height:auto;display:block}
.scroll{max-height:85vh;overflow:auto;border:1px solid #ddd;display:inline-block}
.scroll svg{border:0}.grid{stroke:#eee}.axis{stroke:#999}.tick,.label{font-size:11px;fill:#666}
.ptitle{font-size:12px;font-weight:600;fill:#333}
.prefill{fill:#f28e2b}.decode{fill:#4e79a7}.queued{fill:#d5d5d5}
.q-waiting,.q-running{fill:none;stroke-width:1.5}.q-waiting{stroke:#e15759}.q-running{stroke:#59a14f}
.kv-used{fill:#4e79a7}.kv-cached{fill:#8cd1c9}.kv-free{fill:#efefef}
.hov{fill:#000;fill-opacity:0}.hov:hover{fill-opacity:.07}
.band{fill:#f6f6f6}.band2{fill:#fff}.lane:hover .band,.lane:hover .band2{fill:#fff4d6}
.pm-swap{fill:#d62728}.pm-recompute{fill:#9467bd}.pm{stroke:#fff;stroke-width:.5}
.fin-stop{fill:#2ca02c}.fin-length{fill:#e6b800}.fin-abort{fill:#8c564b}.fin-other{fill:#555}
.cursor{stroke:#000;stroke-opacity:.45;pointer-events:none}
#clock{position:fixed;right:12px;top:8px;background:#222;color:#fff;padding:2px 8px;
  border-radius:4px;font-size:12px;display:none}
"""

# a cursor line in every time chart, following the mouse over any of them
SCRIPT = """
(() => {
  const svgs = [...document.querySelectorAll("svg[data-wall]")];
  const clock = document.getElementById("clock");
  const cursors = svgs.map(svg => {
    const l = document.createElementNS("http://www.w3.org/2000/svg", "line");
    l.setAttribute("class", "cursor"); l.setAttribute("y2", svg.viewBox.baseVal.height);
    return svg.appendChild(l);
  });
  const show = (x, on) => cursors.forEach(l => {
    l.setAttribute("x1", x); l.setAttribute("x2", x); l.style.display = on ? "" : "none";
  });
  show(0, false);
  for (const svg of svgs) svg.addEventListener("mousemove", e => {
    const r = svg.getBoundingClientRect(), d = svg.dataset;
    const x = (e.clientX - r.left) * svg.viewBox.baseVal.width / r.width;
    const on = x >= +d.x0 && x <= +d.x1;
    show(x, on);
    clock.style.display = on ? "block" : "none";
    clock.textContent = "t = " + ((x - d.x0) / (d.x1 - d.x0) * d.wall).toFixed(3) + " s";
  });
  document.body.dataset.rendered = "ok";
})();
"""


def _legend(items: list[tuple[str, str]]) -> str:
    return '<div class="legend">' + "".join(
        f'<i style="background:{c}"></i>{_e(t)}' for t, c in items) + "</div>"


def _header(header: dict, t: dict) -> str:
    tok, blk, wall = t["tokens"], t["blocks"], t["wall"]
    n_tok = tok["prefill"] + tok["decode"]
    cards = [
        ("steps", f"{t['steps']:,}", f"mean {_s(t['busy'] / max(t['steps'], 1))} a step"),
        ("wall time", _s(wall), f"busy {t['busy'] / wall:.0%}" if wall else "no steps"),
        ("tokens", f"{n_tok:,}", f"prefill {tok['prefill']:,} · decode {tok['decode']:,}"
         + (f" · {n_tok / wall:,.0f} tok/s" if wall else "")),
        ("requests", f"{t['arrived']:,} arrived", "finished " + (", ".join(
            f"{v} {k}" for k, v in t["finished"].most_common()) or "none")),
        ("preemptions", f"{sum(t['preempted'].values()):,}",
         f"swap {t['preempted']['swap']} · recompute {t['preempted']['recompute']}"),
        ("prefix hits (blocks)", f"{blk['hit_device'] + blk['hit_host']:,}",
         f"device {blk['hit_device']:,} · host {blk['hit_host']:,}"),
        ("swaps (blocks)", f"{blk['swapped_out'] + blk['swapped_in']:,}",
         f"out {blk['swapped_out']:,} · in {blk['swapped_in']:,} · offloaded "
         f"{blk['offloaded']:,}"),
        ("peak queues", f"{t['max_waiting']} waiting", f"{t['max_running']} running"),
    ]
    html_cards = "".join(f'<div class="card" data-total="{_e(k)}"><span>{_e(k)}</span>'
                         f"<b>{_e(v)}</b><span>{_e(sub)}</span></div>" for k, v, sub in cards)
    engine = {k: v for k, v in header.items() if k not in ("type", "version", "start", "config")}
    engine.update(header.get("config") or {})
    rows = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v if isinstance(v, str) else json.dumps(v))}"
                   "</td></tr>" for k, v in engine.items())
    return (f'<div class="cards">{html_cards}</div><details open><summary>engine config'
            f"</summary><table>{rows}</table></details>")


def render_html(header: dict, steps: list[dict]) -> str:
    """The trace of `read_trace` as one HTML page, with nothing to fetch."""
    t = totals(header, steps)
    axis = Axis(t["wall"] or 1.0)
    body = [_header(header, t)]
    if not steps:
        body.append('<p class="empty">No steps recorded: the trace holds only its header.</p>')
    else:
        body += [
            "<h2>Steps, queues and KV cache over wall time</h2>",
            _legend([("decode tokens", "#4e79a7"), ("prefill tokens", "#f28e2b"),
                     ("waiting", "#e15759"), ("running", "#59a14f"), ("KV used", "#4e79a7"),
                     ("KV cached (free, holds a prefix)", "#8cd1c9"), ("KV free", "#efefef")]),
            timeline(header, steps, axis),
            "<h2>Requests (one lane per sequence)</h2>",
            _legend([("queued", "#d5d5d5"), ("prefill chunk", "#f28e2b"), ("decode", "#4e79a7"),
                     ("▼ preempted: swap", "#d62728"), ("▼ preempted: recompute", "#9467bd"),
                     ("● stop", "#2ca02c"), ("● length", "#e6b800"), ("● abort", "#8c564b")]),
            f'<div class="scroll">{gantt(steps, axis)}</div>',
        ]
    start = header.get("start")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(start)) if start else "unknown"
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>nano-vLLM step trace, {when}</title><style>{CSS}</style></head><body>"
            f'<div id="clock"></div><h1>nano-vLLM step trace</h1><p class="sub">started {when}'
            f", trace version {_e(header.get('version'))}</p>" + "\n".join(body)
            + f"<script>{SCRIPT}</script></body></html>\n")
