"""OpenAI's wire format: request bodies (to SamplingParams) and response shapes (errors.py
holds the error bodies)."""

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from nanovllm.core.errors import InvalidRequestError
from nanovllm.core.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # top logprobs per token, as vLLM's default max_logprobs


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerateRequest(BaseModel):
    """Fields common to completions and chat completions (None: the engine's default)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extensions: lower priority is served first; timeout in seconds from arrival
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise InvalidRequestError(
                f"at most {MAX_LOGPROBS} top logprobs per token can be returned, not {logprobs}",
                "top_logprobs" if isinstance(self, ChatCompletionRequest) else "logprobs",
            )
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        return SamplingParams(
            n=self.n,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            **{k: v for k, v in given.items() if v is not None},
        )


class CompletionRequest(_GenerateRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; null fills the context
    logprobs: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise InvalidRequestError("prompt is empty; give a string or token ids", "prompt")
        return list(p)

    def sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs)


class ChatCompletionRequest(_GenerateRequest):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(self.max_output_tokens, logprobs)

    @property
    def max_output_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def flatten_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content given as a list of parts becomes one string: templates expect text."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise InvalidRequestError(
                        f"messages[{i}].content: only text parts are supported", "messages"
                    )
                texts.append(str(part.get("text", "")))
            m = {**m, "content": "".join(texts)}
        out.append(m)
    return out


# ---- response shapes --------------------------------------------------------------------

LogprobEntries = list[tuple[int, dict[int, float]]]  # per token: (sampled id, {id: logprob})


class _Shape:
    """What /v1/completions and /v1/chat/completions share: a choice is its index, a body
    (`_body`, per endpoint) and how it ended."""

    obj = chunk_obj = ""

    def __init__(self, req: Any, token_str: Callable[[int], str]) -> None:
        self.req, self.token_str = req, token_str

    def opening(self, num_choices: int) -> list[dict]:
        return []

    def choice(
        self,
        i: int,
        text: str,
        entries: LogprobEntries,
        finish: str | None,
        stop: Any,
        delta: bool = False,
    ) -> dict:
        return {"index": i, **self._body(i, text, entries, delta),
                "finish_reason": finish, "stop_reason": stop}

    def _body(self, i: int, text: str, entries: LogprobEntries, delta: bool) -> dict:
        raise NotImplementedError


class CompletionShape(_Shape):
    """/v1/completions: objects, choices and logprobs as OpenAI's legacy completions API."""

    obj, chunk_obj = "text_completion", "text_completion"

    def __init__(self, req: CompletionRequest, token_str: Callable[[int], str]) -> None:
        super().__init__(req, token_str)
        self.offsets: dict[int, int] = defaultdict(int)  # text_offset so far, per choice

    def _body(self, i: int, text: str, entries: LogprobEntries, delta: bool) -> dict:
        lp = self._logprobs(i, entries) if self.req.logprobs is not None else None
        return {"text": text, "logprobs": lp}

    def _logprobs(self, i: int, entries: LogprobEntries) -> dict[str, list]:
        # top_logprobs: the top N plus the sampled token, so up to N + 1 entries
        s = self.token_str
        tokens, token_lps, top, offsets = [], [], [], []
        for token_id, lps in entries:
            tokens.append(s(token_id))
            token_lps.append(lps.get(token_id))
            top.append({s(t): lp for t, lp in lps.items()})
            offsets.append(self.offsets[i])
            self.offsets[i] += len(tokens[-1])
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return dict(zip(keys, (tokens, token_lps, top, offsets)))


class ChatShape(_Shape):
    """/v1/chat/completions: a message per choice, or deltas (role first, then content)."""

    obj, chunk_obj = "chat.completion", "chat.completion.chunk"

    def opening(self, num_choices: int) -> list[dict]:
        role = {"role": "assistant", "content": ""}
        return [
            {"index": i, "delta": role, "logprobs": None, "finish_reason": None,
             "stop_reason": None}
            for i in range(num_choices)
        ]

    def _body(self, i: int, text: str, entries: LogprobEntries, delta: bool) -> dict:
        lp = self._logprobs(entries) if self.req.logprobs else None
        if delta:
            return {"delta": {"content": text} if text else {}, "logprobs": lp}
        return {"message": {"role": "assistant", "content": text}, "logprobs": lp}

    def _logprobs(self, entries: LogprobEntries) -> dict[str, list]:
        k = self.req.top_logprobs or 0

        def item(token_id: int, lp: float | None) -> dict[str, Any]:
            s = self.token_str(token_id)
            return {"token": s, "logprob": lp, "bytes": list(s.encode(errors="replace"))}

        content = []
        for token_id, lps in entries:
            top = [item(t, lp) for t, lp in sorted(lps.items(), key=lambda kv: -kv[1])[:k]]
            content.append({**item(token_id, lps.get(token_id)), "top_logprobs": top})
        return {"content": content}


ResponseShape = CompletionShape | ChatShape
