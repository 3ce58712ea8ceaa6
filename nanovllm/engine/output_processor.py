"""What the engine reports about its requests after each step: their text (decoded as
tokens arrive), stop strings (which end a sequence in the step that completes one), and
their outputs, whole or as deltas."""

import dataclasses
from collections.abc import Callable

from nanovllm.core.sampling_params import SamplingParams
from nanovllm.core.sequence import FinishReason, Sequence, SequenceStatus
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.messages import DeltaRow
from nanovllm.engine.outputs import CompletionOutput, RequestOutput
from nanovllm.engine.tokenizer import Tokenizer

# ends a sequence wherever it is and frees its blocks (Scheduler.finish)
FinishSeq = Callable[[Sequence, FinishReason, int | str | None], None]


class _Sent:
    """What a delta request's completion has reported so far."""

    __slots__ = ("tokens", "chars", "logprobs", "done")

    def __init__(self) -> None:
        self.tokens = self.chars = self.logprobs = 0
        self.done = False


@dataclasses.dataclass
class Request:
    """One request as the engine tracks it: its n sequences and what their text is."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    texts: list[str]
    arrival_time: float
    stream: bool = False
    delta: bool = False  # outputs carry only what is new since the request's previous one
    detokenize: bool = True  # False: no text unless stop strings need it (the caller decodes)
    holdback: int = 0  # delta streams: chars withheld, as they may begin a stop string
    sent: list[_Sent] = dataclasses.field(default_factory=list)  # delta: per completion

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # a loop, not all(): this runs for every row on every step
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True


class OutputProcessor:
    """Turns sampled tokens into text and outputs, request by request.

    `on_token` runs for every token a sequence takes; the requests it touches are reported
    by the next `take`: streamed requests after every token, others once they finish.
    """

    def __init__(self, tokenizer: Tokenizer, finish_seq: FinishSeq) -> None:
        self.tokenizer = tokenizer
        self.finish_seq = finish_seq
        self._touched: dict[str, Request] = {}

    def new_request(
        self, request_id: str, prompt: str | None, ids: list[int], params: SamplingParams,
        seqs: list[Sequence], arrival: float, stream: bool, delta: bool, detokenize: bool,
    ) -> Request:
        skip = params.skip_special_tokens
        req = Request(
            request_id, prompt, ids, params, seqs,
            [IncrementalDetokenizer(self.tokenizer, skip) for _ in seqs], [""] * len(seqs),
            arrival, stream, delta,
            detokenize or bool(params.stop_list),  # stop strings are found in the text
        )
        if delta:
            req.sent = [_Sent() for _ in seqs]
            if stream and params.stop_list:
                req.holdback = max(len(s) for s in params.stop_list) - 1
        return req

    def on_token(self, req: Request, i: int, seq: Sequence) -> None:
        """Completion `i` of `req` took a token (and may have finished)."""
        if seq.sampling_params.stop_list or (req.stream and req.detokenize):
            self._update_text(req, i, seq)  # incremental: streaming, or stop strings
        elif seq.is_finished and req.detokenize:
            req.texts[i] = self._decode(seq)
        if req.stream or seq.is_finished:
            self._touched[req.request_id] = req

    def on_finish(self, req: Request, i: int, seq: Sequence) -> None:
        """Completion `i` was ended from outside (abort, timeout): its final text."""
        text = self._decode(seq) if req.detokenize else ""
        if req.stream:  # what streaming already showed may end before a held-back tail
            text = text if text.startswith(req.texts[i]) else req.texts[i]
        req.texts[i] = text

    def take(self) -> list[tuple[Request, RequestOutput | None]]:
        """Each request touched since the last call, with its output if it is due."""
        touched, self._touched = self._touched, {}
        taken = []
        for req in touched.values():
            finished = req.finished
            due = req.stream or finished
            taken.append((req, self.output(req, finished) if due else None))
        return taken

    def take_delta_rows(self) -> tuple[list[DeltaRow], list[Request]]:
        """`take` for delta requests (all of them: the server's engine process), without
        RequestOutput objects: each completion that moved, as a row of messages.Delta's
        fields, and the requests that finished."""
        touched, self._touched = self._touched, {}
        rows, done = [], []
        for req in touched.values():
            finished = req.finished
            if not (req.stream or finished):
                continue
            self._moved(req, rows)
            if finished:
                done.append(req)
        return rows, done

    def output(self, req: Request, finished: bool | None = None) -> RequestOutput:
        """The request's output now: whole, or only what is new for a delta request."""
        if req.delta:  # from the rows the server sends
            outs = [CompletionOutput(i, text, ids, reason, stop_reason, lps)
                    for _, i, text, ids, lps, reason, stop_reason, _, _ in self._moved(req, [])]
        else:
            outs = []
            for i, seq in enumerate(req.seqs):
                reason = seq.finish_reason.value if seq.finish_reason else None
                lps = seq.logprobs if seq.sampling_params.logprobs is not None else None
                outs.append(CompletionOutput(
                    i, req.texts[i], seq.resolved_output_token_ids, reason, seq.stop_reason, lps,
                ))  # fmt: skip
        if finished is None:
            finished = req.finished
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished,
                             *_cached_and_queued(req))

    # ---- text and stop strings ------------------------------------------------------

    def _update_text(self, req: Request, i: int, seq: Sequence) -> None:
        detok = req.detoks[i]
        before = len(detok.output_text)
        detok.step([seq.last_token])
        text = detok.output_text
        sp = seq.sampling_params
        if sp.stop_list and seq.num_output_tokens >= sp.min_tokens:
            longest = max(len(s) for s in sp.stop_list)
            search_from = max(0, before - longest + 1)
            hits = [(text.find(s, search_from), s) for s in sp.stop_list]
            hits = [(pos, s) for pos, s in hits if pos != -1]
            if hits:
                pos, stop = min(hits)
                req.texts[i] = (
                    text[: pos + len(stop)] if sp.include_stop_str_in_output else text[:pos]
                )
                if seq.is_finished:
                    seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
                else:
                    self.finish_seq(seq, FinishReason.STOP, stop)
                return
        req.texts[i] = self._decode(seq) if seq.is_finished else text

    def _decode(self, seq: Sequence) -> str:
        """A completion's whole text, decoded at once (its final form)."""
        skip = seq.sampling_params.skip_special_tokens
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=skip)

    def _moved(self, req: Request, rows: list[DeltaRow]) -> list[DeltaRow]:
        """Appends to `rows` (and returns it) a delta request's completions that moved since
        its previous output, each with only what is new (see LLMEngine.add_request), as rows
        of messages.Delta's fields. Runs for every streamed row on every step."""
        rid, texts, holdback = req.request_id, req.texts, req.holdback
        cached, queued = _cached_and_queued(req)
        for i, (seq, sent) in enumerate(zip(req.seqs, req.sent)):
            if sent.done:
                continue
            finished = seq.is_finished
            prompt = seq.num_prompt_tokens
            start, stop = prompt + sent.tokens, seq.num_resolved_tokens
            if start == stop and not finished:
                continue  # this completion did not move
            text, chars = texts[i], sent.chars
            end = len(text) if finished else max(chars, len(text) - holdback)
            lps = None
            if seq.sampling_params.logprobs is not None:
                lps = seq.logprobs[sent.logprobs :]
                sent.logprobs = len(seq.logprobs)
            reason = seq.finish_reason
            rows.append((rid, i, text[chars:end], seq.token_ids[start:stop], lps,
                         reason.value if reason else None, seq.stop_reason, cached, queued))
            sent.tokens, sent.chars, sent.done = stop - prompt, end, finished
        return rows


def _cached_and_queued(req: Request) -> tuple[int, float | None]:
    """A request's prompt tokens found in the prefix cache, and its seconds waiting before
    it was first scheduled (None until then)."""
    first = req.seqs[0]
    queued = None
    if first.first_scheduled_time is not None:
        queued = first.first_scheduled_time - first.arrival_time
    return first.num_cached_prefix_tokens, queued
