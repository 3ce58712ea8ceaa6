from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated completion (a request with n > 1 has several)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | timeout | error
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    logprobs: list[dict[int, float]] | None = None
    # LLM.chat with a reasoning parser or tools: `text` read as its parts (engine/chat_output)
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list | None = None  # engine/tool_calls.ToolCall


@dataclass
class RequestOutput:
    """The state of one request: its prompt and each completion so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    queue_time: float | None = None  # seconds from arrival to first scheduled, once known

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    # shortcuts to the first completion, the common case of n == 1
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
