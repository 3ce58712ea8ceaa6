"""The serving benchmark's report (benchmarks/serve.py): each rate's figures from its
requests' results (summarize, timeline), a table row per request rate and a PNG of the
latency percentiles and throughput against the rate."""

import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.serve_client import Result


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    xs = sorted(values)

    def pct(q: float) -> float:  # linear interpolation, as numpy's default
        k = (len(xs) - 1) * q / 100
        lo, hi = math.floor(k), math.ceil(k)
        return 1000 * (xs[lo] + (xs[hi] - xs[lo]) * (k - lo))

    return {"mean": 1000 * sum(xs) / len(xs), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(rate, results: list["Result"], reqs, duration: float, cpu: float) -> dict:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    wrong_len = sum(r.output_tokens != q.output_len for r, q in zip(results, reqs) if r.ok)
    return {
        "rate": "inf" if math.isinf(rate) else rate,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "wrong_length": wrong_len,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "output_tokens": out_tokens,
        "tokens_per_chunk": out_tokens / max(1, sum(r.chunks for r in ok)),
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "tpot_ms": percentiles(
            [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        ),
        "e2e_ms": percentiles([r.e2e for r in ok]),
        "client_cpu_frac": cpu / duration,
    }


def timeline(results: list["Result"], start_at: float) -> dict:
    """When, in seconds from the run's start, the requests went out (first and last), the
    first text came back, and the first and last request ended: with the engine's own step
    trace (its header's unix start) this says whether a run's time went to the client, the
    front ends or the engine."""
    ok = [r for r in results if r.ok]
    if not ok:
        return {}
    sent = [r.sent_at - start_at for r in results]
    ended = [r.ended_at - start_at for r in ok]
    return {"first_sent": min(sent), "last_sent": max(sent),
            "first_text": min(r.first_at for r in ok) - start_at,
            "first_ended": min(ended), "last_ended": max(ended)}


def print_table(runs: list[dict]) -> None:
    head = f"{'rate':>6} {'ok':>5} {'req/s':>7} {'tok/s':>8}"
    for m in ("ttft", "itl", "tpot", "e2e"):
        head += f" | {m + ' p50/p90/p99 ms':>26}"
    print(head)
    for r in runs:
        line = f"{r['rate']!s:>6} {r['completed']:>5} {r['request_throughput']:>7.2f} "
        line += f"{r['output_throughput']:>8.1f}"
        for m in ("ttft", "itl", "tpot", "e2e"):
            p = r[f"{m}_ms"]
            cells = "/".join("-" if p[k] is None else f"{p[k]:.0f}" for k in ("p50", "p90", "p99"))
            line += f" | {cells:>26}"
        print(line)
        if r["failed"]:
            print(f"       {r['failed']} failed: {r['errors']}")
        t = r.get("timeline_s")
        if t:
            print(f"       client timeline: sent {t['first_sent']:.2f}-{t['last_sent']:.2f} s, "
                  f"first text {t['first_text']:.2f} s, ended {t['first_ended']:.2f}-"
                  f"{t['last_ended']:.2f} s")
        if r["wrong_length"]:
            print(f"       {r['wrong_length']} responses had a different length than asked")
        if r["client_cpu_frac"] > 0.8:
            print(
                f"       warning: a client process used {r['client_cpu_frac']:.0%} of a core; "
                "its overhead may limit these figures (try --client-procs)"
            )


def plot(runs: list[dict], path: Path, title: str, offline: dict | None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is missing; pip install matplotlib (or -e '.[bench]')")
        return
    xs = list(range(len(runs)))
    labels = [str(r["rate"]) for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, (metric, name) in zip(
        axes, [("ttft_ms", "TTFT"), ("itl_ms", "inter-token latency"), ("e2e_ms", "end to end")]
    ):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(xs, [r[metric][q] for r in runs], style, label=q)
        ax.set_title(f"{name} (ms)")
        ax.set_yscale("log")
        ax.legend()
    ax = axes[3]
    ax.plot(xs, [r["output_throughput"] for r in runs], "o-", label="server")
    if offline:
        offline_tps = offline["output_throughput"]
        ax.axhline(offline_tps, color="gray", ls="--", label="offline LLM.generate")
    ax.set_title("output tokens/s")
    ax.legend()
    for ax in axes:
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and coefficient of variation (sample standard deviation / mean) of repeated runs."""
    n = len(values)
    mean = sum(values) / n
    if n < 2 or mean == 0:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, var**0.5 / mean


def runs_to_resolve(cv_a: float, cv_b: float, change: float = 0.05) -> int:
    """Runs of each side so that the 95% interval of the ratio of their means is within
    +-change/2: then a `change` between two commits stands out of the noise. Ratio of means,
    log scale: its standard error is sqrt(cv_a^2 + cv_b^2) / sqrt(n)."""
    return max(1, math.ceil((1.96 * math.hypot(cv_a, cv_b) / (change / 2)) ** 2))


def print_ratio(server: list[float], offline: list[float], goal: float) -> dict:
    """Saturated server against offline throughput, best/best and mean/mean, with how many
    runs of each this host needs to see a 5% change. Returns the figures for the report."""
    best = max(server) / max(offline)
    (ms, cs), (mo, co) = spread(server), spread(offline)
    out = {"best_over_best": best, "mean_over_mean": ms / mo, "server_cv": cs,
           "offline_cv": co}
    verdict = "meets" if best >= goal else "does NOT meet"
    print(f"server at rate inf / offline throughput: best/best {best:.3f}, mean/mean "
          f"{ms / mo:.3f} ({verdict} the {goal:g} goal)")
    if len(server) > 1 and len(offline) > 1:
        n = runs_to_resolve(cs, co)
        out["runs_for_5pct"] = n
        print(f"run-to-run spread: server {cs:.1%}, offline {co:.1%} (coefficient of "
              f"variation over {len(server)} / {len(offline)} runs): {n} runs of each to see "
              f"a 5% change")
    return out
