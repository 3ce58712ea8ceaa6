"""`nanovllm serve`: the OpenAI-compatible HTTP server (entrypoints/openai runs it)."""

import argparse
import glob
import os

from nanovllm.entrypoints.cli.arguments import engine_config


def port(text: str) -> int:
    """A TCP port number (argparse names this function in its message for "abc")."""
    number = int(text)
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{number} is not a TCP port; use 1 to 65535")
    return number


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind; 0.0.0.0 serves other machines too")
    g.add_argument("--port", type=port, default=8000, help="TCP port to listen on")
    g.add_argument(
        "--api-key", metavar="KEY", default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and /detokenize "
        "(default: $NANOVLLM_API_KEY, or no key); /health stays open",
    )
    g.add_argument(
        "--protect-metrics", action="store_true",
        help="with an API key, /metrics requires it too (default: /metrics is open, like "
        "/health, for a Prometheus scraper)",
    )
    g.add_argument(
        "--log-requests", action=argparse.BooleanOptionalAction, default=True,
        help="log a line per finished request: its tokens, TTFT, total time and finish "
        "reason (default); --no-log-requests keeps a busy server's log to start-up, errors "
        "and the engine's periodic lines",
    )
    g.add_argument(
        "--served-model-name", metavar="NAME", default=None,
        help="the model name clients send (default: the model directory's or file's name)",
    )
    g.add_argument("--max-num-waiting", type=int, metavar="N", default=256,
                   help="requests allowed to wait in the engine; more get HTTP 429")
    g.add_argument("--max-request-bytes", type=int, metavar="N", default=1 << 20,
                   help="larger request bodies get HTTP 413")
    g.add_argument("--data-parallel-size", type=int, metavar="N", default=1,
                   help="engine processes behind this server, one per GPU (or a share of the "
                   "CPU each); each request goes to the one caching its prompt's prefix "
                   "unless that one is busier than the others")
    g.add_argument("--api-server-count", type=int, metavar="N", default=None,
                   help="front-end processes sharing the port (HTTP, tokenizing, streaming), "
                   "each talking to every engine process, for when one front end's core "
                   "cannot stream what the engines generate (default: 2 when the engines "
                   "run on a GPU, 1 on a CPU)")
    g.add_argument("--drain-timeout", type=float, metavar="SECONDS", default=5.0,
                   help="on a stop (SIGTERM, Ctrl-C), how long requests in flight may run "
                   "on before they are cancelled; new connections are refused meanwhile")
    g.add_argument("--log-interval", type=float, metavar="SECONDS", default=10.0,
                   help="time between the engine's status lines")


def default_api_server_count(device: str) -> int:
    """2 front ends for engines on a GPU (one front end's core cannot stream all that a GPU's
    engine generates at a thousand prompts), 1 on a CPU, whose cores the
    engine needs. The front end does not load torch, so "auto" looks for an NVIDIA device
    as torch would find one: the driver's device files, unless CUDA_VISIBLE_DEVICES hides
    them all."""
    if device != "auto":
        return 2 if device == "cuda" else 1
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 1
    return 2 if glob.glob("/dev/nvidia[0-9]*") else 1


def cmd_serve(args: argparse.Namespace) -> int:
    if args.api_server_count is None:
        args.api_server_count = default_api_server_count(args.device)
    from nanovllm.entrypoints.openai.metrics_dir import make_metrics_dir, remove_metrics_dir

    if args.api_server_count > 1:
        # several front ends share their metrics through files; prometheus_client reads
        # where when it is first imported, just below
        make_metrics_dir()
    # FastAPI only when serving
    from nanovllm.engine.messages import EngineProcessConfig
    from nanovllm.entrypoints.openai.launch import run_server
    from nanovllm.entrypoints.openai.serving import ServerSettings

    engine = EngineProcessConfig(
        args.model, engine_config(args), args.max_num_waiting, args.log_interval
    )
    server = ServerSettings(
        args.host, args.port, args.api_key, args.served_model_name, args.max_request_bytes,
        args.protect_metrics, args.data_parallel_size, args.api_server_count,
        args.log_requests, args.drain_timeout,
    )
    try:
        return run_server(engine, server)
    finally:
        remove_metrics_dir()
