"""The engine loop: requests in, one scheduled step at a time, outputs out."""

import dataclasses
import itertools
import logging
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.config import EngineConfig
from nanovllm.core.errors import ConfigError, InvalidRequestError
from nanovllm.core.sampling_params import SamplingParams
from nanovllm.core.scheduler import ScheduledBatch, Scheduler
from nanovllm.core.sequence import FinishReason, Sequence
from nanovllm.core.trace import SchedulerTrace
from nanovllm.core.validation import as_token_ids, check_prompt
from nanovllm.engine.chat_output import for_template
from nanovllm.engine.messages import DeltaRow
from nanovllm.engine.output_processor import OutputProcessor, Request
from nanovllm.engine.outputs import RequestOutput
from nanovllm.engine.reasoning import ReasoningParser
from nanovllm.engine.resolve import fit_kv_cache, resolve_config
from nanovllm.engine.step_times import StepTimes
from nanovllm.engine.structured_output import Grammars, StructuredOutputs
from nanovllm.engine.tokenizer import load_tokenizer
from nanovllm.engine.tool_parsers import detect_tool_call_parser
from nanovllm.model.config import ModelConfig
from nanovllm.model.loader.source import open_model
from nanovllm.model.parallel import SINGLE
from nanovllm.worker.model_runner import ModelRunner, StepHandle

T = TypeVar("T")

log = logging.getLogger("nanovllm")


class LLMEngine:
    """The engine loop: add requests, `step()` until none is left, read outputs.

    One step: the scheduler picks which tokens of which sequences run; the runner launches
    the forward pass and sampling; the scheduler advances the batch (tokens computed, a
    placeholder for each token being sampled); the step's tokens are then resolved (the
    placeholders replaced, stop conditions checked, text and outputs updated). With overlap
    (the GPU default) a step's tokens are resolved while the next step runs on the device.
    """

    def __init__(
        self, model: str | None = None, config: EngineConfig | None = None, **options
    ) -> None:
        """`model`: a model directory or .gguf file (None: the default model); engine
        options as an EngineConfig or as keywords (`max_num_seqs=...`), not both."""
        if config is None:
            config = EngineConfig.from_options(**options)
        elif options:
            raise ConfigError("pass engine options as an EngineConfig or as keywords, not both")
        source = open_model(model)
        self.model_config = ModelConfig.from_hf(source.hf_config)
        self.tokenizer = load_tokenizer(source)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(
            self.model_config.eos_token_ids
        )
        resolved = resolve_config(config, self.model_config, source.gguf is not None)
        peers = None
        if resolved.tensor_parallel_size > 1:
            from nanovllm.worker.tensor_parallel import Peers

            peers = Peers(source.path, resolved, self.eos_token_ids)
        try:
            self.runner = ModelRunner(resolved, source, self.model_config, self.eos_token_ids,
                                      tp=peers.tp if peers else SINGLE, peers=peers)
        except BaseException:
            if peers is not None:
                peers.shutdown()
            raise
        if peers is not None:  # the other ranks go with this engine, or at exit
            weakref.finalize(self, self.runner.shutdown)
        try:
            self.config = fit_kv_cache(resolved, self.runner.measure_kv_blocks(),
                                       self.runner.measure_host_blocks())
            self.runner.setup(self.config)
        except BaseException:
            self.runner.shutdown()  # a second engine in this process may start now
            raise
        log.info("engine: %s", self.config.summary())
        cfg = self.config
        self.block_manager = BlockManager(
            cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.num_host_blocks,
            offload=cfg.cpu_offload_gib > 0, cache_events=config.kv_events_endpoint is not None,
        )
        self.kv_events = None
        if config.kv_events_endpoint is not None:
            from nanovllm.engine.kv_events import KVEventPublisher

            self.kv_events = KVEventPublisher(config.kv_events_endpoint, cfg.block_size,
                                              config.kv_events_topic)
            log.info("KV cache events on %s", self.kv_events.endpoint)
        self.scheduler = Scheduler(cfg, self.block_manager, self.eos_token_ids,
                                   self.runner.preemption_cost)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler.finish)
        self.reasoning = (ReasoningParser(config.reasoning_parser)
                          if config.reasoning_parser else None)
        # `</think>`'s id: where a constraint on the answer starts (None: not one token)
        self._reasoning_end = (self.tokenizer.backend.token_to_id(self.reasoning.end)
                               if self.reasoning else None)
        if self.reasoning and self._reasoning_end is None:
            log.warning("reasoning_parser=%s: the tokenizer has no %s token; replies are "
                        "still split, but constrained requests will be refused",
                        self.reasoning.kind, self.reasoning.end)
        # how the model writes tool calls (tool_choice "auto"): as asked, or read from the
        # chat template; None when neither names a format
        self.tool_call_parser = (
            detect_tool_call_parser(self.tokenizer.chat_template)
            if config.tool_call_parser == "auto" else config.tool_call_parser)
        self._structured: StructuredOutputs | None = None  # built for the first constraint
        self.requests: dict[str, Request] = {}
        self._owner: dict[int, tuple[Request, int]] = {}  # seq id -> (request, completion index)
        self._seq_counter = itertools.count()
        self._req_counter = itertools.count()
        self._inflight: StepHandle | None = None  # launched, tokens not yet resolved
        # schedule step N+1 while the device runs step N; benchmarks switch it between runs
        self.overlap = cfg.overlap
        self.num_prefill_tokens = 0  # totals, for progress bars and metrics
        self.num_decode_tokens = 0
        self.num_generated_tokens = 0  # sampled tokens, prefill's last token included
        self.num_steps = 0
        self.num_prefill_steps = 0  # of those, steps that ran prompt tokens (alone or mixed)
        self.times = StepTimes()
        self.timing = self.times.totals
        self.trace: SchedulerTrace | None = None
        if config.trace:
            self.trace = SchedulerTrace(config.trace, cfg, self.scheduler, self.block_manager)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (also done when the engine is
        garbage-collected or the process exits); a no-op for one device."""
        self.runner.shutdown()

    # ---- requests -----------------------------------------------------------------

    def render_chat(self, messages: list[dict], parse_special_tokens: bool = False,
                    **template_kwargs) -> list[int]:
        """Token ids of a conversation with the chat template applied and a reply to come;
        special-token text in a message is plain text unless `parse_special_tokens`.
        `template_kwargs` reach the template (tools, enable_thinking, ...)."""
        return self.tokenizer.render_chat(for_template(messages), True, parse_special_tokens,
                                          **template_kwargs)

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
        constraint = params.structured_outputs
        if constraint is not None:  # compiled before anything is queued: errors lose nothing
            matchers = [self.structured.compile(constraint) for _ in range(params.n)]
        now = time.monotonic()
        seqs = []
        for i in range(params.n):  # completion i of a seeded request draws with seed + i
            p = params if params.seed is None or i == 0 else dataclasses.replace(
                params, seed=params.seed + i)
            seqs.append(Sequence(next(self._seq_counter), ids, p, now, priority))
        text = prompt if isinstance(prompt, str) else None
        req = self.outputs.new_request(request_id, text, ids, params, seqs, now, stream, delta,
                                       detokenize)
        self.requests[request_id] = req
        for i, seq in enumerate(seqs):
            self._owner[seq.seq_id] = (req, i)
            if constraint is not None:
                self.structured.add(seq, matchers[i])
            self.scheduler.add(seq)
            if self.trace:
                self.trace.arrived(request_id, seq)
        return request_id

    @property
    def structured(self) -> StructuredOutputs:
        """The running sequences' structured-output constraints (the grammar engine loads
        on the first request that has one)."""
        if self._structured is None:
            if self.reasoning is not None and self._reasoning_end is None:
                raise ConfigError(
                    f"reasoning_parser={self.reasoning.kind}: this tokenizer has no "
                    f"{self.reasoning.end} token, so structured output cannot tell where "
                    "the answer starts; start the engine without a reasoning parser")
            grammars = Grammars(self.tokenizer.backend.to_str(), self.model_config.vocab_size,
                                self.eos_token_ids)
            self._structured = StructuredOutputs(grammars, self._reasoning_end)
        return self._structured

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
                self.outputs.on_finish(req, i, seq)
            self._owner.pop(seq.seq_id, None)
            if self._structured is not None:
                self._structured.drop(seq.seq_id)
        return self.outputs.output(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- the loop -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the outputs of the requests that moved (see
        add_request). With overlap, outputs trail the device by one step."""
        return self._step(self._outputs)

    def step_delta_rows(self) -> tuple[list[DeltaRow], list[str]]:
        """`step` for an engine whose requests were all added with `delta=True` (the
        server's engine process): each completion that moved as a row of messages.Delta's
        fields, and the ids of the requests that finished. No RequestOutput is built: a
        streamed row's output costs the host under half as much."""
        return self._step(self._delta_rows)

    def _step(self, collect: Callable[[], T]) -> T:
        trace = self.trace
        start = trace.begin() if trace else 0.0
        with self.times("schedule"):
            batch = self.scheduler.schedule()
        if trace:
            trace.scheduled(batch)
        prev, self._inflight = self._inflight, None
        if prev is not None and not self._can_overlap(batch):
            self._resolve(prev)  # penalties read the previous token: it must be on the host
            prev, batch = None, batch.without_finished()
        if not batch and batch.has_copies:
            self.runner.copy_blocks(batch)  # every row ended: the copies still must run
        if batch:
            self._count(batch)
            masks = None
            if self._structured and self._structured.constrains(batch.sampling_seqs):
                masks = self._masks(batch, prev)  # resolves `prev` before the bitmask
            with self.times("launch"):
                handle = self.runner.launch(batch, prev, masks)
            if masks is not None:
                prev = None
        if prev is not None:
            self._resolve(prev)  # the previous step's tokens, while this one runs
        if batch:
            with self.times("postprocess"):
                self.scheduler.advance(batch)
            if self.overlap:
                self._inflight = handle
            else:
                self._resolve(handle)
        with self.times("outputs"):  # streamed requests: one output each step
            outputs = collect()
        if trace:
            trace.end(start)
        if self.kv_events:
            self.kv_events.publish(self.block_manager.take_cache_events())
        return outputs

    def _masks(self, batch: ScheduledBatch, prev: StepHandle | None) -> Callable:
        """What the runner calls once the step's forward pass is queued: the previous step's
        tokens resolved (each advances its constraint), then the rows' bitmask for sampling,
        filled on the host while the device runs the forward pass."""
        def fill():
            if prev is not None:
                self._resolve(prev)
            with self.times("grammar"):
                return self._structured.bitmask(batch.sampling_seqs)

        return fill

    def _can_overlap(self, batch: ScheduledBatch) -> bool:
        return self.overlap and not any(
            s.sampling_params.uses_penalties for s in batch.seqs
        )

    def _count(self, batch: ScheduledBatch) -> None:
        num_decode = sum(1 for s in batch.sampling_seqs if s.num_scheduled_tokens == 1)
        self.num_decode_tokens += num_decode
        self.num_prefill_tokens += batch.num_tokens - num_decode
        self.num_steps += 1
        self.num_prefill_steps += batch.num_tokens > num_decode

    def _resolve(self, handle: StepHandle) -> None:
        """A launched step's tokens: into their sequences, then into text and outputs."""
        with self.times("wait"):
            out = self.runner.collect(handle)
        with self.times("postprocess"):
            self.num_generated_tokens += len(out.token_ids)
            structured = self._structured if self._structured and self._structured.by_seq else None
            for seq in self.scheduler.resolve(handle.seqs, out.token_ids, out.logprobs):
                if structured is not None:  # a complete or failed constraint ends it
                    reason = structured.accept(seq, seq.token_ids[-1])
                    if reason is not None and not seq.is_finished:
                        self.scheduler.finish(seq, reason)
                owner = self._owner.get(seq.seq_id)
                if owner is not None:
                    self.outputs.on_token(*owner, seq)

    def _outputs(self) -> list[RequestOutput]:
        outputs = []
        for req, out in self.outputs.take():
            if out is not None:
                outputs.append(out)
            if out is not None and out.finished:
                self._forget(req)
        return outputs

    def _delta_rows(self) -> tuple[list[DeltaRow], list[str]]:
        rows, done = self.outputs.take_delta_rows()
        for req in done:
            self._forget(req)
        return rows, [req.request_id for req in done]

    def _forget(self, req: Request) -> None:
        """A finished request, reported: the engine holds nothing of it any more."""
        del self.requests[req.request_id]
        for seq in req.seqs:
            del self._owner[seq.seq_id]
            if self._structured is not None:
                self._structured.drop(seq.seq_id)
