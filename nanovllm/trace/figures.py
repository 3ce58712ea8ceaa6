"""What the step trace's pictures show, worked out from its records (core/step_trace.py):
the run's totals, the steps bucketed over wall time for the charts, and one lane per sequence.
The HTML page (render.py) and the PNG summary (summary.py) draw the same figures.

Past MAX_POINTS steps the charts show time buckets (a bucket's mean tokens per step, its
longest queues, its mean KV use), and a lane's decode steps less than a pixel apart merge into
one bar, so a 20,000-step, 2,000-request trace is a page of a few megabytes at most.
"""

import itertools
from collections import Counter
from dataclasses import dataclass, field

MAX_POINTS = 1500  # time buckets of the charts, about one per pixel of the plot
KV_FIELDS = ("used", "cached", "free")


def totals(header: dict, steps: list[dict]) -> dict:
    """The run in figures: what the page's header shows."""
    tokens, blocks = Counter(), Counter()
    for s in steps:
        blocks.update(s.get("blocks", {}))
        for r in s["rows"]:
            tokens[r["kind"]] += r["tokens"]
    events = lambda key: [e for s in steps for e in s[key]]  # noqa: E731
    wall = steps[-1]["t"] + steps[-1]["dur"] if steps else 0.0
    return {
        "steps": len(steps), "wall": wall, "busy": sum(s["dur"] for s in steps),
        "tokens": tokens, "blocks": blocks, "arrived": len(events("arrived")),
        "finished": Counter(f["reason"] for f in events("finished")),
        "preempted": Counter(p["kind"] for p in events("preempted")),
        "max_waiting": max((s["waiting"] for s in steps), default=0),
        "max_running": max((s["running"] for s in steps), default=0),
    }


@dataclass
class Point:
    """One bucket of steps, as the charts draw it."""
    t0: float
    t1: float
    steps: list[dict]
    prefill: float = 0.0  # mean tokens per step
    decode: float = 0.0
    waiting: int = 0  # the most in the bucket
    running: int = 0
    kv: dict = field(default_factory=dict)  # tier -> field -> mean blocks


def points(steps: list[dict], wall: float, n: int = MAX_POINTS) -> list[Point]:
    """The steps in at most `n` points: each step alone, or past `n` steps one point per 1/n
    of the wall time (idle time stays a gap)."""
    key = (lambda s: s["step"]) if len(steps) <= n else \
        (lambda s: min(n - 1, int(s["t"] / wall * n)))
    out = []
    for g in (list(g) for _, g in itertools.groupby(steps, key)):
        tok = Counter()
        for s in g:
            for r in s["rows"]:
                tok[r["kind"]] += r["tokens"]
        kv = {tier: {f: sum(s["kv"].get(tier, {}).get(f, 0) for s in g) / len(g)
                     for f in KV_FIELDS} for tier in ("device", "host")}
        out.append(Point(g[0]["t"], g[-1]["t"] + g[-1]["dur"], g, tok["prefill"] / len(g),
                         tok["decode"] / len(g), max(s["waiting"] for s in g),
                         max(s["running"] for s in g), kv))
    return out


@dataclass
class Segment:
    kind: str  # "queued", "prefill" or "decode"
    t0: float
    t1: float
    first: int = 0  # steps
    last: int = 0
    tok0: int = 0  # the sequence's tokens computed: from tok0 to tok1 of total
    tok1: int = 0
    total: int = 0


@dataclass
class Lane:
    """One sequence's life: queued, prefill chunks, decode runs, preemptions, its finish."""
    req: str
    seq: int
    arrived: float | None = None
    prompt: int | None = None
    segments: list[Segment] = field(default_factory=list)
    preempted: list[tuple[float, str, int]] = field(default_factory=list)  # (t, kind, step)
    finished: tuple[float, str, int] | None = None  # (t, reason, output tokens)
    waiting_since: float | None = None

    def queue_until(self, t: float) -> None:
        if self.waiting_since is not None and t > self.waiting_since:
            self.segments.append(Segment("queued", self.waiting_since, t))
        self.waiting_since = None


def lanes(steps: list[dict], pixel: float) -> list[Lane]:
    """One lane per sequence, in order of first appearance; rows of one kind closer than
    `pixel` seconds merge (decode runs always, prefill chunks once narrower than 2 pixels)."""
    by_seq: dict[int, Lane] = {}

    def lane(e: dict) -> Lane:
        if e["seq"] not in by_seq:
            by_seq[e["seq"]] = Lane(str(e["req"]), e["seq"])
        return by_seq[e["seq"]]

    for s in steps:
        t, end, step = s["t"], s["t"] + s["dur"], s["step"]
        for a in s["arrived"]:  # added before this step was scheduled
            ln = lane(a)
            ln.arrived, ln.prompt, ln.waiting_since = t, a.get("prompt_tokens"), t
        for p in s["preempted"]:
            ln = lane(p)
            ln.preempted.append((t, p["kind"], step))
            ln.waiting_since = t
        for r in s["rows"]:
            ln = lane(r)
            ln.queue_until(t)
            last = ln.segments[-1] if ln.segments else None
            if (last and last.kind == r["kind"] and t - last.t1 < pixel
                    and (r["kind"] == "decode" or last.t1 - last.t0 < 2 * pixel)):
                last.t1, last.last, last.tok1, last.total = end, step, r["start"] + r["tokens"], \
                    r["total"]
            else:
                ln.segments.append(Segment(r["kind"], t, end, step, step, r["start"],
                                           r["start"] + r["tokens"], r["total"]))
        for f in s["finished"]:
            ln = lane(f)
            ln.queue_until(end)
            ln.finished = (end, str(f["reason"]), f.get("output_tokens", 0))
    return list(by_seq.values())
