import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.config import EngineConfig
from nanovllm.core.errors import ConfigError, InvalidRequestError
from nanovllm.core.sampling_params import SamplingParams
from nanovllm.core.scheduler import ScheduledBatch, Scheduler
from nanovllm.core.sequence import FinishReason, Sequence, SequenceStatus
from nanovllm.core.validation import as_token_ids, check_prompt
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.outputs import CompletionOutput, RequestOutput
from nanovllm.engine.tokenizer import load_tokenizer
from nanovllm.model.config import ModelConfig
from nanovllm.model.loader.source import open_model
from nanovllm.worker.model_runner import ModelRunner, StepHandle

log = logging.getLogger("nanovllm")


@dataclass
class Request:
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
    sent: list["_Sent"] = dataclasses.field(default_factory=list)  # delta: per completion

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # a loop, not all(): this runs for every row on every step
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True


class _Sent:
    """What a delta request's completion has reported so far."""

    __slots__ = ("tokens", "chars", "logprobs", "done")

    def __init__(self) -> None:
        self.tokens = self.chars = self.logprobs = 0
        self.done = False


class LLMEngine:
    """The engine loop: add requests, `step()` until none is left, read outputs."""

    def __init__(
        self, model: str | None = None, config: EngineConfig | None = None, **options
    ) -> None:
        """`model`: a model directory or .gguf file (None: the default model); engine
        options as an EngineConfig or as keywords (`max_num_seqs=...`), not both."""
        if config is None:
            config = EngineConfig.from_options(**options)
        elif options:
            raise ConfigError("pass engine options as an EngineConfig or as keywords, not both")
        self.config = config
        source = open_model(model)
        self.model_config = ModelConfig.from_hf(source.hf_config)
        self.tokenizer = load_tokenizer(source)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(
            self.model_config.eos_token_ids
        )
        context = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > context:
            raise ConfigError(
                f"max_model_len={config.max_model_len} is longer than the model's context of "
                f"{context} tokens (max_position_embeddings); use at most {context}"
            )
        self.runner = ModelRunner(
            config, source, self.model_config, config.max_model_len, self.eos_token_ids
        )
        kv_tokens = self.runner.num_blocks * config.block_size
        model_len = self.model_config.max_position_embeddings
        if config.max_model_len is None:
            self.max_model_len = min(model_len, kv_tokens)
        else:
            self.max_model_len = config.max_model_len
            if self.max_model_len > kv_tokens:
                raise ConfigError(
                    f"the KV cache holds {kv_tokens} tokens but max_model_len={self.max_model_len} "
                    "needs at least that many for one sequence; lower max_model_len or give the "
                    "cache more memory (num_kv_blocks, kv_cache_gib, gpu_memory_utilization)"
                )
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        on_gpu = self.runner.device.type == "cuda"
        if config.admission_batch is None:  # graphs make decode-only steps the cheap ones
            graphs = on_gpu and not config.enforce_eager
            config.admission_batch = min(16, config.max_num_seqs) if graphs else 1
        self.scheduler = Scheduler(
            config, self.block_manager, self.max_model_len, self.eos_token_ids
        )
        self.runner.setup_steps(self.max_model_len)
        self.overlap = on_gpu if config.overlap is None else config.overlap
        self._inflight: StepHandle | None = None
        self.requests: dict[str, Request] = {}
        self._owner: dict[int, tuple[Request, int]] = {}  # seq id -> (request, completion index)
        self._seq_counter = itertools.count()
        self._req_counter = itertools.count()
        self.num_prefill_tokens = 0  # totals, for progress bars and metrics
        self.num_decode_tokens = 0
        self.num_generated_tokens = 0  # sampled tokens, prefill's last token included
        self.num_steps = 0
        # where a step's wall time goes (seconds, running totals): host work vs waiting on GPU
        self.timing = {"schedule": 0.0, "launch": 0.0, "wait": 0.0, "postprocess": 0.0}

    # ---- requests -----------------------------------------------------------------

    def render_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation with the chat template applied and a reply to come."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # the template writes any BOS itself
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tokenize_prompt(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> list[int]:
        """Token ids of a prompt, checked as every entry point checks them (vocabulary,
        length, and room for `params.max_tokens` in max_model_len)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else as_token_ids(prompt)
        max_tokens = params.max_tokens if params is not None else None
        check_prompt(ids, self.model_config.vocab_size, self.max_model_len, max_tokens)
        return ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        stream: bool = False,
        priority: int = 0,
        delta: bool = False,
        detokenize: bool = True,
    ) -> str:
        """Queue a request; raises InvalidRequestError before anything is queued.

        With `stream`, `step()` reports the request after every token (text included);
        otherwise only once it has finished, which saves detokenizing every step.
        `priority`: lower is served first and may preempt worse running requests.
        `delta`: each output holds only the completions that moved, each with only its new
        token ids, logprobs and text; while streaming, text that may begin a stop string is
        held back until it cannot (so no piece is ever taken back). Serving uses it: no
        copies of whole completions per token.
        `detokenize=False`: outputs carry token ids and no text, except that a request with
        stop strings is still decoded to find them; for callers that decode themselves.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams", "sampling_params")
        if prompt_token_ids is None:
            ids = self.tokenize_prompt(prompt, params)
        else:  # tokenized by the caller (the prompt is kept for the output): checked alike
            ids = as_token_ids(prompt_token_ids, "prompt_token_ids")
            check_prompt(ids, self.model_config.vocab_size, self.max_model_len, params.max_tokens)
        request_id = request_id or str(next(self._req_counter))
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        now = time.monotonic()
        seqs, detoks = [], []
        for i in range(params.n):
            p = (
                params
                if params.seed is None or i == 0
                else dataclasses.replace(params, seed=params.seed + i)
            )
            seqs.append(
                Sequence(next(self._seq_counter), ids, p, arrival_time=now, priority=priority)
            )
            detoks.append(IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens))
        req = Request(
            request_id,
            prompt if isinstance(prompt, str) else None,
            ids,
            params,
            seqs,
            detoks,
            [""] * params.n,
            now,
            stream,
            delta,
            detokenize or bool(params.stop_list),  # stop strings are found in the text
        )
        if delta:
            req.sent = [_Sent() for _ in seqs]
            if stream and params.stop_list:
                req.holdback = max(len(s) for s in params.stop_list) - 1
        self.requests[request_id] = req
        for i, seq in enumerate(seqs):
            self._owner[seq.seq_id] = (req, i)
            self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """End a request now and free its KV blocks; False if it is unknown or already done."""
        return self.finish_request(request_id, reason) is not None

    def finish_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT
    ) -> RequestOutput | None:
        """End a request now, free its KV blocks, and return its final output (the text of
        each completion so far, `reason` for those not already finished); None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for i, seq in enumerate(req.seqs):
            if not seq.is_finished:
                self.scheduler.finish(seq, reason)
                text = self._decode_output(seq) if req.detokenize else ""
                if req.stream:  # what streaming already showed may end before a held-back tail
                    text = text if text.startswith(req.texts[i]) else req.texts[i]
                req.texts[i] = text
            self._owner.pop(seq.seq_id, None)
        return self._make_output(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- the loop -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the requests whose state changed.

        With overlap on, the batch is queued on the GPU and the previous step's tokens are
        processed while it runs: outputs then trail the GPU by one step.
        """
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.timing["schedule"] += t1 - t0
        touched: dict[str, Request] = {}
        if self._inflight is not None and not self._can_overlap(batch):
            self._resolve(self._inflight, touched)
            self._inflight = None
            batch = ScheduledBatch([s for s in batch.seqs if not s.is_finished])
        handle = None
        if batch:
            self._count(batch)
            t1 = time.perf_counter()
            handle = self.runner.launch(batch, self._inflight)
            self.timing["launch"] += time.perf_counter() - t1
        if self._inflight is not None:
            self._resolve(self._inflight, touched)
            self._inflight = None
        if batch:
            t2 = time.perf_counter()
            self.scheduler.advance(batch)
            self.timing["postprocess"] += time.perf_counter() - t2
            if self.overlap:
                self._inflight = handle
            else:
                self._resolve(handle, touched)
        outputs = []
        for req in touched.values():
            finished = req.finished
            if req.stream or finished:
                outputs.append(self._make_output(req, finished))
            if finished:
                del self.requests[req.request_id]
                for seq in req.seqs:
                    del self._owner[seq.seq_id]
        return outputs

    def _can_overlap(self, batch) -> bool:
        # penalties count the previous token, so they need it on the host first
        return self.overlap and not any(s.sampling_params.uses_penalties for s in batch.seqs)

    def _count(self, batch) -> None:
        sampled = batch.sampling_seqs
        num_decode = sum(1 for s in sampled if s.num_scheduled_tokens == 1)
        self.num_decode_tokens += num_decode
        self.num_prefill_tokens += batch.num_tokens - num_decode
        self.num_steps += 1

    def _resolve(self, handle: StepHandle, touched: dict[str, Request]) -> None:
        t0 = time.perf_counter()
        out = self.runner.collect(handle)
        self.num_generated_tokens += len(out.token_ids)
        t1 = time.perf_counter()
        self.timing["wait"] += t1 - t0
        logprobs = {}
        if handle.want_logprobs:
            logprobs = dict(zip((s.seq_id for s in handle.seqs), out.logprobs, strict=True))
        for seq in self.scheduler.resolve(handle.seqs, out.token_ids):
            owner = self._owner.get(seq.seq_id)
            if owner is None:
                continue
            req, i = owner
            if logprobs.get(seq.seq_id) is not None:
                seq.logprobs.append(logprobs[seq.seq_id])
            if seq.sampling_params.stop_list or (req.stream and req.detokenize):
                self._update_text(req, i, seq)  # incremental: streaming, or stop strings
            elif seq.is_finished and req.detokenize:
                req.texts[i] = self._decode_output(seq)
            if req.stream or seq.is_finished:
                touched[req.request_id] = req
        self.timing["postprocess"] += time.perf_counter() - t1

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
                    self.scheduler.finish(seq, FinishReason.STOP, stop)
                return
        req.texts[i] = self._decode_output(seq) if seq.is_finished else text

    def _decode_output(self, seq: Sequence) -> str:
        """A completion's whole text, decoded at once (its final form)."""
        skip = seq.sampling_params.skip_special_tokens
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=skip)

    def _make_output(self, req: Request, finished: bool | None = None) -> RequestOutput:
        if req.delta:
            outs = self._delta_outputs(req)
        else:
            outs = []
            for i, seq in enumerate(req.seqs):
                reason = seq.finish_reason.value if seq.finish_reason else None
                lps = seq.logprobs if seq.sampling_params.logprobs is not None else None
                outs.append(
                    CompletionOutput(
                        i, req.texts[i], seq.resolved_output_token_ids, reason, seq.stop_reason,
                        lps,
                    )
                )
        first = req.seqs[0]
        queued = None
        if first.first_scheduled_time is not None:
            queued = first.first_scheduled_time - first.arrival_time
        if finished is None:
            finished = req.finished
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, outs, finished,
            first.num_cached_prefix_tokens, queued,
        )

    def _delta_outputs(self, req: Request) -> list[CompletionOutput]:
        """A delta request's completions that moved since its previous output, each with
        only what is new (see add_request)."""
        outs = []
        for i, seq in enumerate(req.seqs):
            sent = req.sent[i]
            if sent.done:
                continue
            finished = seq.is_finished
            start, stop = seq.num_prompt_tokens + sent.tokens, seq.num_resolved_tokens
            if start == stop and not finished:
                continue  # this completion did not move
            text = req.texts[i]
            end = len(text) if finished else max(sent.chars, len(text) - req.holdback)
            lps = None
            if seq.sampling_params.logprobs is not None:
                lps = seq.logprobs[sent.logprobs :]
                sent.logprobs = len(seq.logprobs)
            reason = seq.finish_reason.value if seq.finish_reason else None
            new_ids = seq.token_ids[start:stop]
            outs.append(
                CompletionOutput(i, text[sent.chars : end], new_ids, reason, seq.stop_reason, lps)
            )
            sent.tokens, sent.chars, sent.done = stop - seq.num_prompt_tokens, end, finished
        return outs
