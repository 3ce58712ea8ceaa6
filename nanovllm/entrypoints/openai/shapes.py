"""OpenAI's response shapes: a choice of /v1/completions or /v1/chat/completions, whole
or as a streamed chunk (protocol.py holds the request bodies)."""

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from nanovllm.engine.chat_output import ChatOutputParser, ChatReply, ChatReplyStream
from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

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
