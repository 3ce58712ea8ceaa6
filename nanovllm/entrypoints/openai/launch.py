"""`nanovllm serve`: start the engine process, wait until it is ready, serve HTTP."""

import logging
import os
from dataclasses import dataclass

from nanovllm.engine import stack_sampler
from nanovllm.engine.messages import EngineProcessConfig
from nanovllm.engine.tokenizer import load_tokenizer
from nanovllm.entrypoints.openai.api_server import MAX_N, ServerConfig, build_app
from nanovllm.entrypoints.openai.engine_client import EngineClient

log = logging.getLogger("nanovllm.server")


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP side of `nanovllm serve` (the engine's side is an EngineProcessConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: $NANOVLLM_API_KEY, or no key
    served_model_name: str | None = None  # None: the model directory's or file's name
    max_request_bytes: int = 1 << 20


def run_server(engine: EngineProcessConfig, server: ServerSettings) -> int:
    """Start the engine process, wait until it is ready, serve HTTP until stopped."""
    import uvicorn

    from nanovllm.model.loader.source import open_model

    log.setLevel(logging.INFO)
    tokenizer = load_tokenizer(open_model(engine.model))  # fails fast on a bad path
    log.info("starting the engine process (model %s)", engine.model or "default")
    client = EngineClient.start(engine)
    try:
        info = client.info
        config = ServerConfig(
            served_model_name=server.served_model_name or info["model"],
            api_key=server.api_key or os.environ.get("NANOVLLM_API_KEY") or None,
            max_request_bytes=server.max_request_bytes,
            max_n=min(MAX_N, engine.engine.max_num_seqs),
        )
        app = build_app(client, tokenizer, config)
        log.info(
            "serving %r (max_model_len %d) on http://%s:%d%s",
            config.served_model_name,
            info["max_model_len"],
            server.host,
            server.port,
            " (API key required)" if config.api_key else "",
        )
        # NANOVLLM_SAMPLE_STACKS: where time goes (the report is rewritten as it runs:
        # uvicorn ends the process by re-raising SIGTERM, past any `finally`)
        stack_sampler.from_env(".front")
        # per-request log lines replace uvicorn's access log
        uvicorn.run(
            app, host=server.host, port=server.port, access_log=False,
            timeout_graceful_shutdown=5,
        )
    finally:
        client.shutdown()
    return 0
