"""The engine's module switches a benchmark flips for an A/B run, as command-line flags: each
sets one module constant before the engine is built (the constant's own comment says what
it does and what it measured). offline.py takes them all; profile_step.py and kv_store.py
the ones their figures depend on."""

import argparse
import importlib

# flag: (module, constant, the value the flag sets, help)
SWITCHES = {
    "--read-whole-tiles": (
        "nanovllm.kernels.triton_decode", "SKIP_PAST_END", False,
        "an fp8 cache's attention reads each row's last tile whole, past the context's end "
        "(triton_decode.SKIP_PAST_END off; before 2026-12-01)"),
    "--no-k-scale-plane": (
        "nanovllm.worker.kv_cache", "FP8_K_SCALE_PLANE", False,
        "an fp8 K cache's scales after each row, padded to 144 bytes, not in a plane after "
        "each block-head's values (kv_cache.FP8_K_SCALE_PLANE off; before 2026-12-02)"),
    "--no-run-stores": (
        "nanovllm.kernels.triton_kv_store", "RUN_STORES", False,
        "a transposed fp8 V stored token by token, not a prefill chunk's complete runs of 16 "
        "slots 16 bytes a row (triton_kv_store.RUN_STORES off; before 2026-12-02)"),
    "--no-run-heads": (
        "nanovllm.kernels.triton_kv_store", "RUN_HEADS", False,
        "a complete run's V heads all stored by its first token's program one after another, "
        "its tokens reading their V too, not one head a program by its first tokens' programs "
        "(triton_kv_store.RUN_HEADS off; before 2026-12-02)"),
    "--v-with-k": (
        "nanovllm.kernels.triton_kv_store", "V_APART", False,
        "the fused RoPE + store writes each token's V after its K's rotation and store, in the "
        "same program, not from a program of its own (triton_kv_store.V_APART off; before "
        "2026-12-02)"),
    "--no-fresh-prefill": (
        "nanovllm.kernels", "FRESH_PREFILL", False,
        "an fp8 cache's prefill rows read their own positions from the cache, not the step's "
        "K/V as computed (kernels.FRESH_PREFILL off; before 2026-12-02)"),
    "--v-apart-all": (
        "nanovllm.kernels.triton_kv_store", "V_APART_MAX_TOKENS", 1 << 30,
        "the fused RoPE + store stores every launch's V from programs of their own, a prefill "
        "step's too, not only launches of up to 1,024 tokens (triton_kv_store."
        "V_APART_MAX_TOKENS unbounded; on the H200 a 16,384-token step 184 us against 177)"),
    "--no-pdl": (
        "nanovllm.kernels.triton_pdl", "PDL", False,
        "the step's Triton kernels as plain launches, not programmatic dependent ones "
        "(kernels/triton_pdl.py PDL off; before 2026-12-02)"),
    "--argsort-order": (
        "nanovllm.kernels.triton_rank", "RANK_KERNEL", False,
        "the decode's longest-first order by torch's sort, not the ranking kernel "
        "(triton_rank.RANK_KERNEL off; before 2026-12-01)"),
    "--gumbel-sampler": (
        "nanovllm.kernels.triton_cdf_sampling", "INVERSE_CDF", False,
        "greedy / temperature rows sampled by triton_sampling's Gumbel race (a uniform and two "
        "logarithms a token), not by the inverse CDF (triton_cdf_sampling.INVERSE_CDF off; "
        "before 2026-12-02)"),
    "--no-small-gemms": (
        "nanovllm.kernels.triton_linear", "SMALL_GEMMS", False,
        "qkv_proj and gate_up_proj at up to 64 rows by cuBLAS, not a Triton launch under PDL "
        "(triton_linear.SMALL_GEMMS off; before 2026-12-03)"),
    "--gc-freeze": (
        "nanovllm.worker.model_runner", "FREEZE_GC_AFTER_SETUP", True,
        "collect and freeze Python's garbage collector after start-up "
        "(model_runner.FREEZE_GC_AFTER_SETUP)"),
}


def add_switches(ap: argparse.ArgumentParser, *flags: str) -> None:
    """Add `flags` (default: every switch) to `ap`."""
    for flag in flags or SWITCHES:
        ap.add_argument(flag, action="store_true", help=SWITCHES[flag][3])


def apply_switches(args: argparse.Namespace) -> None:
    """Set the constant of each switch given on the command line."""
    for flag, (module, name, value, _) in SWITCHES.items():
        if getattr(args, flag[2:].replace("-", "_"), False):
            setattr(importlib.import_module(module), name, value)
