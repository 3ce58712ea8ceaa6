"""The offline benchmark's printed report: the workload, the model, the device's measured
rates, the speed of light, and one row per engine (benchmarks/offline.py)."""

from benchmarks.speed_of_light import DeviceRates, WorkloadCost


def si(x: float, unit: str) -> str:
    """1.385e13 B -> '13.85 TB'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def fmt_int(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def engine_row(name: str, r: dict, sol_tput: float) -> str:
    if r.get("error"):
        return f"{name:<18} failed: {r['error']}"
    if r.get("throughput") is None:
        return (
            f"{name:<18} timed out after {r['elapsed_s']:.0f} s: {r['finished_requests']} "
            f"requests done, {r['output_tokens']:,} tokens, >= {r['partial_throughput']:,.0f} tok/s"
        )
    frac = r["throughput"] / sol_tput
    return (
        f"{name:<18}{r['elapsed_s']:>8.2f}{r['output_tokens']:>10,}{r['throughput']:>10,.0f}"
        f"{frac:>8.1%}{fmt_int(r.get('prefill_tokens')):>13}{fmt_int(r.get('decode_tokens')):>12}"
        f"{fmt_int(r.get('steps')):>7}"
    )


def print_table(
    report: dict, cost: WorkloadCost, sol: dict, sol_tput: dict, rates: DeviceRates
) -> None:
    w, m = report["workload"], report["model"]
    ours, peer = report["ours"], report["peer"]
    peer_ver = f" | transformers {peer['transformers']}" if peer and "transformers" in peer else ""
    lines = [
        "",
        f"== offline throughput | {rates.device} | torch {report['torch']}{peer_ver} ==",
        f"workload: {w['num_seqs']} seqs, {w['prompt_tokens']:,} prompt / {w['output_tokens']:,} "
        "output tokens, temperature 0.6, ignore_eos, max_model_len 4096",
        f"model:    {m['description']}",
        f"          {m['dtype']}, {m['matmul_params'] / 1e6:.1f}M matmul params, "
        f"KV {m['kv_bytes_per_token'] / 1024:.1f} KiB/token",
        f"device:   copy {rates.bandwidth / 1e12:.3f} TB/s "
        f"(read+write, {rates.copy_bytes >> 20} MiB), {rates.dtype} matmul "
        f"{rates.matmul_rate / 1e12:.1f} TFLOP/s ({rates.matmul_n}^3)",
        f"cost:     KV reads {si(cost.kv_read_bytes, 'B')} ({sol['kv_read_s']:.3f} s) + weights "
        f"{cost.min_steps} steps x {si(cost.weight_bytes_per_step, 'B')} "
        f"({sol['weight_read_s']:.3f} s);",
        f"          prefill {si(cost.prefill_flops, 'FLOP')} ({sol['prefill_compute_s']:.3f} s), "
        f"decode {si(cost.decode_flops, 'FLOP')} ({sol['decode_compute_s']:.3f} s)",
        "speed of light (BW = copy bandwidth, rate = matmul rate):",
    ]
    formulas = {
        "serial": "bytes/BW + FLOPs/rate",
        "per_phase": "prefill/rate + max(bytes/BW, decode/rate)",
        "overlap": "max(bytes/BW, FLOPs/rate)",
    }
    for key, formula in formulas.items():
        mark = "  <- the % of SOL below" if key == "serial" else ""
        lines.append(
            f"  {key:<9} T = {formula:<42}{sol[key]:>8.3f} s {sol_tput[key]:>9,.0f} tok/s{mark}"
        )
    lines += [
        "",
        f"{'engine':<18}{'wall s':>8}{'out tok':>10}{'tok/s':>10}{'of SOL':>8}"
        f"{'prefill tok':>13}{'decode tok':>12}{'steps':>7}",
        engine_row("nano-vLLM", ours, sol_tput["serial"]),
    ]
    if peer is not None:
        name = f"HF CB {peer.get('attn_implementation', '')}".strip()
        lines.append(engine_row(name[:17], peer, sol_tput["serial"]))
    notes = []
    if not ours.get("error"):
        notes.append(
            f"nano-vLLM: load {ours['load_s']:.1f} s, {ours['dtype']}, KV cache "
            f"{ours['kv_cache_tokens']:,} tokens; split by tokens: prefill "
            f"{ours['prefill_tokens']:,} / decode {ours['decode_tokens']:,}"
        )
        st = ours.get("step_timing_s") or {}
        if st:
            notes.append(
                "nano-vLLM host time: "
                + ", ".join(f"{k} {v:.2f} s" for k, v in st.items())
                + f" (wait = host idle on the GPU; steps {ours['steps']})"
            )
        if ours["wrong_length_requests"]:
            notes.append(f"nano-vLLM: {ours['wrong_length_requests']} requests != max_tokens")
    if peer and not peer.get("error"):
        notes.append(
            f"peer: load {peer['load_s']:.1f} s, per-request max_new_tokens via "
            f"ContinuousBatchingManager.add_request; {peer['finished_requests']} done, "
            f"{peer['failed_requests']} failed, {peer['wrong_length_requests']} wrong length"
        )
        if ours.get("throughput") and peer.get("throughput"):
            notes.append(f"speed-up over peer: {ours['throughput'] / peer['throughput']:.2f}x")
    lines += notes
    print("\n".join(lines), flush=True)
