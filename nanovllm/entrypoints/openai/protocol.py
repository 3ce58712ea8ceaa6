"""OpenAI's wire format: request bodies (to SamplingParams) and response shapes (errors.py
holds the error bodies)."""

from collections import defaultdict
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanovllm.core.errors import InvalidRequestError
from nanovllm.core.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    StructuredOutputsParams,
)
from nanovllm.engine.chat_output import ChatOutputParser, ChatReply, ChatReplyStream

MAX_LOGPROBS = 20  # top logprobs per token, as vLLM's default max_logprobs
# what chat templates understand; OpenAI's "developer" is its newer name for "system"
ROLES = ("system", "user", "assistant", "tool", "developer")

# The published bounds are SamplingParams' own (tests/server/test_protocol.py holds them
# equal), so /openapi.json tells what the engine accepts
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
TokenId = Annotated[int, Field(ge=0)]


class _Request(BaseModel):
    """Types as JSON has them (no "1" for 1, no 1 for true), floats finite."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """response_format.json_schema: the schema the reply must follow. `strict` is accepted
    and changes nothing: the grammar engine always holds the reply to the schema."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's request field: one of json (a schema), json_object, regex, choice, grammar."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    model_config = ConfigDict(strict=True, allow_inf_nan=False, populate_by_name=True)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """One message of a chat; other fields (name, tool_calls, ...) reach the template."""

    model_config = ConfigDict(extra="allow")
    role: Literal[ROLES]
    content: str | list[TextPart] | None = None


class _GenerateRequest(_Request):
    """Fields common to completions and chat completions (None: the engine's default)."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: StopString | StopStrings | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extensions: lower priority is served first; timeout in seconds from arrival
    priority: int = 0
    timeout: float | None = Field(None, gt=0)
    # special-token text in a prompt or message ("<|im_start|>") is plain text unless a
    # trusted caller sets this: then it becomes the control tokens it spells
    parse_special_tokens: bool = False
    # structured output: OpenAI's response_format, or vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
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
            structured_outputs=self._structured_outputs(),
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


    def _structured_outputs(self) -> StructuredOutputsParams | None:
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise InvalidRequestError(
                "response_format and structured_outputs both constrain the reply; set one",
                "structured_outputs")
        if so is not None:
            return StructuredOutputsParams(
                json=so.json_, json_object=bool(so.json_object), regex=so.regex,
                choice=so.choice, grammar=so.grammar,
                disable_any_whitespace=so.disable_any_whitespace)
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True, param="response_format")
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError(
                'response_format of type "json_schema" needs json_schema.schema: the JSON '
                "schema the reply must follow", "response_format.json_schema")
        return StructuredOutputsParams(json=rf.json_schema.schema_,
                                       param="response_format.json_schema")


class CompletionRequest(_GenerateRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default; null fills the context
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

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
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI: max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    # tool calling (checked by engine/tool_calls.py, whose errors name the field)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

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


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    parse_special_tokens: bool = False  # as for completions and chat


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def flatten_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a template reads them: text parts joined into one string, and
    "developer" as "system" (templates know no "developer")."""
    out = []
    for m in messages:
        message = m.model_dump(exclude_unset=True)
        if isinstance(m.content, list):
            message["content"] = "".join(part.text for part in m.content)
        message["role"] = "system" if m.role == "developer" else m.role
        out.append(message)
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
    """/v1/chat/completions: a message per choice, or deltas (role first, then content).
    With a reasoning parser or tools, each choice's text is read by `parser`
    (engine/chat_output.py) into reasoning, content and tool calls."""

    obj, chunk_obj = "chat.completion", "chat.completion.chunk"

    def __init__(self, req: ChatCompletionRequest, token_str: Callable[[int], str],
                 parser: ChatOutputParser | None = None) -> None:
        super().__init__(req, token_str)
        active = parser is not None and (parser.reasoning is not None or parser.tools is not None)
        self.parser = parser if active else None
        self.named = parser is not None and parser.tools is not None and isinstance(
            parser.tools.choice, dict)
        self.streams: dict[int, ChatReplyStream] = {}
        self.num_calls: dict[int, int] = defaultdict(int)  # tool calls streamed, per choice

    def opening(self, num_choices: int) -> list[dict]:
        role = {"role": "assistant", "content": ""}
        return [
            {"index": i, "delta": role, "logprobs": None, "finish_reason": None,
             "stop_reason": None}
            for i in range(num_choices)
        ]

    def choice(self, i: int, text: str, entries: LogprobEntries, finish: str | None,
               stop: Any, delta: bool = False) -> dict:
        if self.parser is None:
            return super().choice(i, text, entries, finish, stop, delta)
        lp = self._logprobs(entries) if self.req.logprobs else None
        if delta:
            stream = self.streams.get(i) or self.streams.setdefault(i, self.parser.stream())
            reply = stream.feed(text) if text else ChatReply()
            if finish is not None:
                reply = reply + stream.finish()
            body = {"delta": self._message(reply, i, delta=True), "logprobs": lp}
        else:
            reply = self.parser.parse(text)
            body = {"message": {"role": "assistant", **self._message(reply, i, delta=False)},
                    "logprobs": lp}
        calls = self.num_calls[i] > 0 if delta else bool(reply.tool_calls)
        if finish == "stop" and calls and not self.named:
            finish = "tool_calls"  # OpenAI's reason when the model called tools
        return {"index": i, **body, "finish_reason": finish, "stop_reason": stop}

    def _message(self, reply: ChatReply, i: int, delta: bool) -> dict:
        out: dict[str, Any] = {}
        if reply.reasoning is not None or (not delta and self.parser.reasoning is not None):
            # vLLM's names: reasoning_content, and the newer reasoning
            out["reasoning_content"] = out["reasoning"] = reply.reasoning
        if reply.content is not None or not delta:
            out["content"] = reply.content
        if reply.tool_calls:
            calls = []
            for call in reply.tool_calls:
                calls.append({"index": self.num_calls[i], **call.to_openai()})
                self.num_calls[i] += 1
            out["tool_calls"] = calls if delta else [
                {k: v for k, v in c.items() if k != "index"} for c in calls]
        elif not delta and self.parser.tools is not None:
            out["tool_calls"] = []
        return out

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
