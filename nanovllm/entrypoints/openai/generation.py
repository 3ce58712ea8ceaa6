"""One HTTP generation request as engine requests: a request per prompt, each with `n`
completions, their Deltas merged back into one stream of choices (decoded here when the
engine does not decode them), with the latency metrics and a log line per prompt."""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from nanovllm.core.sampling_params import SamplingParams
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.messages import AddRequest, Delta
from nanovllm.entrypoints.openai.serving import GenerateRequest, Server

log = logging.getLogger("nanovllm.server")


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    detok: IncrementalDetokenizer | None = None  # streams the engine does not decode


@dataclass
class _Sub:
    """One engine request: one prompt, n completions."""

    request_id: str
    prompt_index: int
    num_prompt_tokens: int
    left: int  # completions not finished
    sent: bool = False  # handed to the engine pipe
    added: bool = False  # accepted by the engine
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    queue_time: float | None = None


class Generation:
    """An HTTP request's prompts as engine requests, merged into one stream of choices.
    Choice index = prompt index * n + completion index, as OpenAI numbers them."""

    def __init__(
        self,
        server: Server,
        prefix: str,
        req: GenerateRequest,
        params: SamplingParams,
        prompts: list[list[int]],
    ) -> None:
        self.server, self.req, self.params, self.prompts = server, req, params, prompts
        self.n = params.n
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.arrival = time.monotonic()
        self.subs = {
            f"{self.id}-{i}": _Sub(f"{self.id}-{i}", i, len(ids), self.n)
            for i, ids in enumerate(prompts)
        }
        self.choices = [_Choice() for _ in range(len(prompts) * self.n)]
        # A stream without stop strings is decoded here, off the engine's critical path (the
        # engine decodes what has stop strings, to end the sequence in the step that made one)
        self.detokenize = not req.stream or bool(self.params.stop_list)
        if not self.detokenize:
            skip = self.params.skip_special_tokens
            for c in self.choices:
                c.detok = IncrementalDetokenizer(server.tokenizer, skip)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    async def start(self) -> None:
        """Add every prompt to the engine; on a rejection, abort those already added."""
        r = self.req
        self.server.open.add(self)
        try:
            for sub, ids in zip(self.subs.values(), self.prompts):
                # not streamed: the engine sends one Delta per completion, at its end
                add = AddRequest(sub.request_id, ids, self.params, r.priority, r.timeout,
                                 r.stream, self.detokenize)
                sub.sent = True  # from here the engine may hold it, even if we are cancelled
                await self.server.client.add(add, self.queue)
                sub.added = True
        except BaseException:
            self.close()
            raise

    async def delta_batches(self) -> AsyncIterator[list[tuple[int, Delta]]]:
        """[(choice index, Delta)] until every completion has finished. Everything already
        queued is taken at once and merged per choice, so a client that falls behind the
        engine gets fewer, larger chunks instead of a growing backlog of tiny ones."""
        left = len(self.choices)
        while left:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            merged: dict[int, Delta] = {}
            for d in items:
                if isinstance(d, Exception):
                    self._end_with_error()
                    raise d
                sub = self.subs[d.request_id]
                i = sub.prompt_index * self.n + d.index
                choice = self.choices[i]
                if choice.detok is not None:
                    d.text = choice.detok.step(d.token_ids)
                    if d.finish_reason is not None:
                        d.text += choice.detok.flush()
                self._observe(sub, choice, d)
                left -= d.finish_reason is not None
                merged[i] = merged[i].merge(d) if i in merged else d
            yield list(merged.items())

    async def collect(self) -> None:
        async for _ in self.delta_batches():
            pass

    def _observe(self, sub: _Sub, choice: _Choice, d: Delta) -> None:
        now, m, stream = time.monotonic(), self.server.metrics, self.req.stream
        choice.token_ids += d.token_ids
        if not stream:  # the whole text is answered at the end; a stream has sent its pieces
            choice.text.append(d.text)
            if d.logprobs:
                choice.logprobs += zip(d.token_ids, d.logprobs)
        sub.num_cached_tokens = max(sub.num_cached_tokens, d.num_cached_tokens)
        if sub.queue_time is None and d.queue_time is not None:
            sub.queue_time = d.queue_time
            m.queue_time.observe(d.queue_time)
        if d.token_ids and choice.first_token_time is None:
            choice.first_token_time = now
            if sub.first_token_time is None and stream:  # unknown when not streamed
                sub.first_token_time = now
                m.ttft.observe(now - self.arrival)
        if d.finish_reason is None:
            return
        choice.finish_reason, choice.stop_reason = d.finish_reason, d.stop_reason
        if stream and len(choice.token_ids) > 1:
            m.tpot.observe((now - choice.first_token_time) / (len(choice.token_ids) - 1))
        sub.left -= 1
        if sub.left == 0:
            m.e2e.observe(now - self.arrival)
            self._log(sub)

    def _log(self, sub: _Sub) -> None:
        if not self.server.settings.log_requests:
            return
        mine = self.choices[sub.prompt_index * self.n : (sub.prompt_index + 1) * self.n]
        reasons = ",".join(sorted({c.finish_reason or "abort" for c in mine}))
        ttft = f"{sub.first_token_time - self.arrival:.3f}s" if sub.first_token_time else "-"
        log.info(
            "%s: prompt %d tokens (%d cached), completion %d tokens, TTFT %s, total %.3fs, %s",
            sub.request_id,
            sub.num_prompt_tokens,
            sub.num_cached_tokens,
            sum(len(c.token_ids) for c in mine),
            ttft,
            time.monotonic() - self.arrival,
            reasons,
        )

    def _end_with_error(self) -> None:
        """The engine is gone: what has not finished ends with finish reason "error"."""
        for choice in self.choices:
            choice.finish_reason = choice.finish_reason or "error"
        for sub in self.subs.values():
            if sub.added and sub.left > 0:
                sub.left = 0
                self._log(sub)

    def close(self) -> None:
        """Abort what has not finished (the client left, or an error); idempotent."""
        if self.closed:
            return
        self.closed = True
        self.server.open.discard(self)
        for sub in self.subs.values():
            unfinished = sub.sent and sub.left > 0
            # an abort queued behind its own add (the pipe keeps order) ends it even when the
            # client left before the engine accepted it; the engine ignores unknown ids
            self.server.client.release(sub.request_id, abort=unfinished)
            if unfinished and sub.added:
                self._log(sub)

    def usage(self) -> dict[str, Any]:
        prompt = sum(s.num_prompt_tokens for s in self.subs.values())
        completion = sum(len(c.token_ids) for c in self.choices)
        cached = sum(s.num_cached_tokens for s in self.subs.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def header(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.server.model_name,
        }
