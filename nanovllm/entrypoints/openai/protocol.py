"""OpenAI's wire format: the request bodies, checked and turned into SamplingParams (the
response shapes are in shapes.py, the error bodies in errors.py)."""

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
