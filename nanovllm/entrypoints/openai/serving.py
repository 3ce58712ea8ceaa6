"""The server's settings, and what every route shares: the engine client, the tokenizer, the
limits and the metrics, and the checks that turn a request body into prompts and sampling
parameters."""

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from nanovllm.core.errors import InvalidRequestError
from nanovllm.core.sampling_params import SamplingParams
from nanovllm.core.validation import as_token_ids, check_prompt
from nanovllm.engine.chat_output import ChatTools, for_template
from nanovllm.engine.chat_template import ChatTemplate, render_plain_contents
from nanovllm.engine.tokenizer import Tokenizer
from nanovllm.entrypoints.openai.errors import APIError
from nanovllm.entrypoints.openai.metrics import Metrics
from nanovllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    flatten_messages,
)
from nanovllm.entrypoints.openai.replicas import ReplicaSet

MAX_N = 16  # completions per request, also capped by max_num_seqs
GenerateRequest = CompletionRequest | ChatCompletionRequest


def _named_parameters(*functions: Callable) -> frozenset[str]:
    return frozenset(
        name
        for f in functions
        for name, p in inspect.signature(f).parameters.items()
        if p.kind is not p.VAR_KEYWORD
    )


# chat_template_kwargs may not set what the server passes itself: an argument of a function
# on the rendering path (a TypeError, or a switch such as parse_special_tokens, otherwise),
# or a special token the template reads from the model
RESERVED_TEMPLATE_KWARGS = _named_parameters(
    Tokenizer.apply_chat_template, Tokenizer.render_chat, ChatTemplate.render,
    render_plain_contents,
) | {"bos_token", "eos_token", "unk_token", "pad_token"}


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP side of `nanovllm serve` (the engine's side is an EngineProcessConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: $NANOVLLM_API_KEY, or no key (launch.resolved)
    served_model_name: str | None = None  # None: the model directory's or file's name
    max_request_bytes: int = 1 << 20
    protect_metrics: bool = False  # /metrics needs the API key too
    data_parallel_size: int = 1  # engine processes behind this front end (replicas.py)
    api_server_count: int = 1  # front-end processes sharing the port (front_ends.py)
    log_requests: bool = True  # a line per finished request
    # seconds a stop (SIGTERM, Ctrl-C) lets the requests in flight finish before it cancels
    # them (uvicorn's graceful shutdown; --drain-timeout)
    drain_timeout: float = 5.0


class Server:
    """What the routes share: the engine client, the tokenizer, limits and metrics."""

    def __init__(self, client: ReplicaSet, tokenizer: Tokenizer, settings: ServerSettings) -> None:
        self.client, self.tokenizer, self.settings = client, tokenizer, settings
        self.model_name = settings.served_model_name
        self.max_model_len: int = client.info.max_model_len
        self.vocab_size: int = client.info.vocab_size
        self.max_n = min(MAX_N, client.info.max_num_seqs)
        self.reasoning_parser = client.info.reasoning_parser
        self.tool_call_parser = client.info.tool_call_parser
        self.metrics = Metrics(self.model_name)
        self.created = int(time.time())
        # the Generations started and not yet closed (generation.py): a stop whose drain
        # timed out cancels their responses, and the app's shutdown closes what is left
        self.open: set = set()

    def check_model(self, model: str | None) -> None:
        """404 unless `model` (when given) is the one served."""
        if model is not None and model != self.model_name:
            msg = f"model {model!r} does not exist; this server serves {self.model_name!r}"
            raise APIError(404, msg, "model", "model_not_found")

    def chat_tools(self, req: ChatCompletionRequest) -> ChatTools | None:
        """The request's tools, checked; None when it has none."""
        if req.tools is None and req.tool_choice is None:
            return None
        return ChatTools(req.tools, req.tool_choice, req.parallel_tool_calls,
                         self.tool_call_parser)

    def sampling_params(self, req: GenerateRequest, tools: ChatTools | None = None
                        ) -> SamplingParams:
        """The request's sampling parameters (with the grammar that forces tool calls when
        `tools` asks for it); 400 when they are invalid or n is too large."""
        params = req.sampling_params()
        if tools is not None:
            params = tools.constrain(params)
        if params.n > self.max_n:
            msg = f"n={params.n} is too large; use at most {self.max_n}"
            raise APIError(400, msg, "n", "invalid_value")
        return params

    def prompt_ids(
        self, prompt: str | list[int], max_tokens: int | None, parse_special_tokens: bool
    ) -> list[int]:
        """A completion prompt's token ids, checked as the engine checks them; special-token
        text is plain text unless `parse_special_tokens`."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, parse_special_tokens=parse_special_tokens)
        else:
            ids = as_token_ids(prompt)
        check_prompt(ids, self.vocab_size, self.max_model_len, max_tokens, "prompt")
        return ids

    def chat_ids(self, req: ChatCompletionRequest, max_tokens: int | None,
                 tools: ChatTools | None = None) -> list[int]:
        """A chat's rendered token ids (with `tools` for the template), checked as the
        engine checks them."""
        ids = self.render_chat(req, tools)
        check_prompt(ids, self.vocab_size, self.max_model_len, max_tokens, "messages")
        return ids

    def render_chat(self, req: ChatCompletionRequest | TokenizeRequest,
                    tools: ChatTools | None = None) -> list[int]:
        """As LLMEngine.render_chat: the template writes any BOS itself, and special-token
        text inside a message is plain text unless the request sets parse_special_tokens."""
        kwargs = getattr(req, "chat_template_kwargs", None) or {}
        reserved = next((k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS), None)
        if reserved is not None:
            msg = (f"chat_template_kwargs.{reserved}: the server sets {reserved!r} itself; "
                   "remove it (messages and add_generation_prompt are request fields)")
            raise APIError(400, msg, "chat_template_kwargs", "invalid_value")
        if tools is not None and tools.template_tools:
            if "tools" in kwargs:
                raise APIError(400, "chat_template_kwargs.tools: the request's tools field "
                               "sets it; remove one", "chat_template_kwargs", "invalid_value")
            kwargs = {**kwargs, "tools": tools.template_tools}
        messages = for_template(flatten_messages(req.messages))
        return self.tokenizer.render_chat(
            messages, req.add_generation_prompt, req.parse_special_tokens, **kwargs
        )

    def decode(self, ids: list[int]) -> str:
        """/detokenize: any ids of the vocabulary (not a prompt: empty, or long, is fine)."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            msg = f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            raise InvalidRequestError(msg, "tokens")
        return self.tokenizer.decode(ids)

    @lru_cache(maxsize=1 << 16)  # noqa: B019 (one Server per process)
    def token_str(self, token_id: int) -> str:
        """One token's text, special tokens included (logprobs name tokens by it)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
