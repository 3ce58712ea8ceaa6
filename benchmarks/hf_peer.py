"""The same offline workload through Hugging Face transformers' continuous batching, paged SDPA.

`generate_batch` takes one `max_new_tokens` for every request, so it cannot run this workload
(each sequence has its own max_tokens). Its engine can: we drive the `ContinuousBatchingManager`
that `generate_batch` wraps (`init_continuous_batching`, `warmup`, `start`, `add_request` with a
per-request `max_new_tokens`, `get_result`, `stop`), exactly as `generate_batch` does, with the
same workload hints.

API differences handled (5.17 on the GPU machine, 5.24 here):
- 5.24 runs paged attention under `attn_implementation="sdpa"` and switches to flash attention
  when it is installed unless `ContinuousBatchingConfig(auto_switch_to_flash=False)`.
- 5.17 has no such switch: it switches "sdpa" to flash when installed, so we ask for
  "paged|sdpa", which it keeps.
"""

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import torch


class PeerTimeout(RuntimeError):
    pass


def _cb_config(config_cls: type) -> tuple[str, object]:
    """The attention implementation to load the model with, and the continuous batching config,
    such that this transformers version runs paged SDPA (see the module docstring)."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    kwargs = {}
    if "auto_switch_to_flash" in fields:
        attn = "sdpa"
        kwargs["auto_switch_to_flash"] = False
    else:
        attn = "paged|sdpa"
    if "seed" in fields:
        kwargs["seed"] = 0
    return attn, config_cls(**kwargs)


def _wait_for(manager, pending: set[str], results: dict, deadline: float) -> None:
    """Move finished results for `pending` request ids from the manager's output queue into
    `results` (kept on a timeout, for a partial count)."""
    while pending:
        result = manager.get_result(timeout=0.5)
        if result is None:
            if not manager.is_running():
                fatal = getattr(manager.background_thread_status, "fatal_error", None)
                raise RuntimeError(f"the generation thread stopped: {fatal!r}")
            if time.perf_counter() > deadline:
                raise PeerTimeout(f"{len(pending)} requests unfinished at the deadline")
            continue
        if result.is_finished() and result.request_id in pending:
            pending.discard(result.request_id)
            results[result.request_id] = result


def _describe(cb_config) -> dict[str, str]:
    keep = (
        "page_size",
        "block_size",
        "num_blocks",
        "max_batch_tokens",
        "max_requests_per_batch",
        "max_memory_percent",
        "use_cuda_graph",
        "use_async_batching",
        "scheduler_type",
        "allow_block_sharing",
    )
    return {k: repr(getattr(cb_config, k)) for k in keep if hasattr(cb_config, k)}


def run_peer(
    model_dir: Path,
    prompts: Sequence[list[int]],
    max_tokens: Sequence[int],
    device: str,
    dtype: torch.dtype,
    timeout_s: float,
) -> dict:
    """Run the workload; returns a dict of figures (throughput is None if it timed out)."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    attn, cb_config = _cb_config(ContinuousBatchingConfig)
    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation=attn
    ).to(device)
    model.eval()
    load_s = time.perf_counter() - t_load
    # temperature 0.6 alone: top_k / top_p set to their "off" values, as SamplingParams defaults;
    # eos -1 is transformers' "no EOS", i.e. ignore_eos
    gen_config = GenerationConfig(
        do_sample=True,
        temperature=0.6,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max(max_tokens),
        eos_token_id=-1,
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in prompts),
        max_generated_length=max(max_tokens),
        num_requests=len(prompts),
    )
    manager = model.init_continuous_batching(
        generation_config=gen_config, continuous_batching_config=cb_config, workload_hints=hints
    )
    t_warm = time.perf_counter()
    manager.warmup()  # what generate_batch does first: capture CUDA graphs, if it uses them
    manager.start()
    out: dict = {
        "transformers": transformers.__version__,
        "attn_implementation": model.config._attn_implementation,
        "load_s": load_s,
        "cb_config": _describe(manager.continuous_batching_config),
        "per_request_max_new_tokens": True,
    }
    timed_out = False
    pending: set[str] = set()
    results: dict[str, object] = {}
    try:
        # one short request first, as our engine gets its one warm-up call
        manager.add_request(list(prompts[0][:11]), "warmup", max_new_tokens=16, eos_token_id=-1)
        _wait_for(manager, {"warmup"}, {}, time.perf_counter() + timeout_s)
        out["warmup_s"] = time.perf_counter() - t_warm
        ids = [f"req_{i}" for i in range(len(prompts))]
        pending = set(ids)
        start = time.perf_counter()
        for rid, p, m in zip(ids, prompts, max_tokens):
            manager.add_request(list(p), rid, max_new_tokens=m, eos_token_id=-1)
        try:
            _wait_for(manager, pending, results, start + timeout_s)
        except PeerTimeout:
            timed_out = True
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30, hard_stop=timed_out)
        manager.destroy()
    errors = [r.request_id for r in results.values() if getattr(r, "error", None)]
    lengths = {rid: len(r.generated_tokens) for rid, r in results.items()}
    want = dict(zip([f"req_{i}" for i in range(len(prompts))], max_tokens))
    tokens = sum(lengths.values())
    out.update(
        elapsed_s=elapsed,
        output_tokens=tokens,
        prompt_tokens=sum(len(p) for p in prompts),
        finished_requests=len(results),
        failed_requests=len(errors),
        wrong_length_requests=sum(1 for rid, n in lengths.items() if n != want[rid]),
        timed_out=timed_out,
        throughput=None if timed_out else tokens / elapsed,
        # on a timeout: finished requests' tokens / time so far, a floor on its token rate
        partial_throughput=tokens / elapsed,
    )
    return out
