"""Load the engine for `generate` and `chat`, logging what happens (shown with --verbose)."""

import argparse
import logging
import time

from nanovllm.core.config import EngineConfig
from nanovllm.entrypoints.ctrl_c import ctrl_c_kept

log = logging.getLogger("nanovllm.cli")


def load_engine(args: argparse.Namespace, config: EngineConfig):
    """An LLMEngine for `args.model` (the default model when None)."""
    start = time.perf_counter()
    with ctrl_c_kept():
        log.info("loading %s", args.model or "the default model, SmolLM2-135M-Instruct")
        from nanovllm.engine.llm_engine import LLMEngine  # torch: seconds, after the line

        engine = LLMEngine(args.model, config)
    log.info("ready in %.1f s (context: %d tokens)", time.perf_counter() - start,
             engine.max_model_len)
    return engine
