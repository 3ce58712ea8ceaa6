"""Structured output: each request's constraint compiled by llguidance into a matcher, and
each step's allowed tokens as a bitmask the sampler applies (docs/structured-output.md).

llguidance was chosen over xgrammar by measurement (benchmarks/grammar_engines.py): it
bounds the work a hostile schema or grammar can cause (fuel limits, below), needs neither
torch nor transformers, reads Lark grammars, and compiles a constraint in a few
milliseconds; its mask costs tens of microseconds a row, filled on the CPU while the device
runs the step's forward pass.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
from tokenizers import Tokenizer

from nanovllm.core.errors import InvalidRequestError
from nanovllm.core.sampling_params import StructuredOutputsParams
from nanovllm.core.sequence import FinishReason, Sequence

log = logging.getLogger("nanovllm")

# What one constraint may cost the grammar engine, so that no request can stall the engine:
# building the lexer (fuel 100k: at most ~40 ms on a slow 2-core CPU; llguidance's default
# of 1M let `(x{1000}){1000}` take 0.8 s), one mask (llguidance's default), the grammar's
# size and the lexer's states (memory: 1-2 kB a state).
LIMITS = dict(initial_lexer_fuel=100_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=100_000, max_grammar_size=200_000, verbose_errors=False)
CACHE_SIZE = 256  # compiled constraints kept, least recently used dropped first


class Grammars:
    """The engine's grammar compiler: llguidance's view of the tokenizer (built on first
    use: about 0.2 s for a 49k vocabulary) and compiled constraints cached by key. Safe to
    call from a second thread (the server's engine loop compiles there; llguidance releases
    the GIL while it compiles)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # the logits' width: the mask covers every id
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self.limits = llguidance.LLParserLimits(**LIMITS)
        self.hits = self.misses = 0
        self._lock = threading.Lock()  # the cache and the tokenizer's first build

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                text = _text_added_tokens(self.tokenizer_json)
                # llguidance refuses an EOS id past the tokenizer's own vocabulary (a model
                # config's id the tokenizer lacks): those are masked off anyway
                size = Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
                eos = [e for e in self.eos_token_ids if e < size] or None
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size,
                                                         eos_token=eos)
            return self._tokenizer

    def is_cached(self, params: StructuredOutputsParams) -> bool:
        """Whether `compile` would only copy a cached matcher (microseconds)."""
        with self._lock:
            return params.key in self._cache

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `params`' constraint; InvalidRequestError naming
        the field when it does not compile or exceeds LIMITS."""
        key = params.key
        with self._lock:
            proto = self._cache.get(key)
            if proto is not None:
                self.hits += 1
                self._cache.move_to_end(key)
                return proto.deep_copy()
            self.misses += 1
        param = params.field_name()
        try:
            grammar = _grammar(params)
        except ValueError as e:  # llguidance's own account of what is wrong with it
            raise InvalidRequestError(f"{param} does not compile: {e}", param) from None
        try:
            proto = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                         limits=self.limits)
            why = _probe(proto, self.vocab_size)
        except Exception:  # the binding failed: the request fails, not the engine
            log.exception("the grammar engine failed on %s", param)
            raise InvalidRequestError(
                f"{param} could not be compiled: the grammar engine failed on it (the "
                "server's log has the details)", param) from None
        if why is not None:
            if any(s in why for s in ("limit", "too many", "too big", "max is")):
                why += ("; the constraint exceeds what one request may cost the grammar "
                        "engine (docs/structured-output.md): make it smaller or simpler")
            raise InvalidRequestError(f"{param} does not compile: {why}", param)
        with self._lock:
            self._cache[key] = proto
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return proto.deep_copy()


def _text_added_tokens(tokenizer_json: str) -> str:
    """The tokenizer as llguidance should see it. llguidance takes every added token for a
    special token, which no grammar literal matches: Qwen's `<think>` and `<tool_call>` are
    added tokens that are text (special: false), so a grammar's "<tool_call>" would allow
    the token in the mask and then refuse it. Such tokens go into the BPE vocabulary, where
    they are the bytes they spell."""
    tok = json.loads(tokenizer_json)
    model = tok.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict):
        return tokenizer_json
    byte_level = "ByteLevel" in json.dumps(tok.get("pre_tokenizer")) + json.dumps(
        tok.get("decoder"))
    kept = []
    for added in tok.get("added_tokens", []):
        text = added.get("content", "")
        if added.get("special") or not text.isascii() or not text.isprintable():
            kept.append(added)
            continue
        # printable ASCII is itself in the byte-level alphabet, except the space
        vocab[text.replace(" ", "\u0120" if byte_level else "\u2581")] = added["id"]
    if len(kept) == len(tok.get("added_tokens", [])):
        return tokenizer_json
    tok["added_tokens"] = kept
    return json.dumps(tok)


def _grammar(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        compact = {"whitespace_flexible": False} if params.disable_any_whitespace else None
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=compact)
    if kind == "choice":
        return llguidance.grammar_from("choice", list(params.choice))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted


def _probe(proto: llguidance.LLMatcher, vocab_size: int) -> str | None:
    """Why a new matcher fails, or None. The lexer is built lazily, and a regex that
    explodes (`(x{1000}){1000}`) does so at its first lexeme: build the first mask now, and
    take one allowed token on a copy, so that such a constraint is refused before its
    request is queued. (One that explodes later ends its request with finish_reason
    "error".)"""
    if not proto.is_error():
        mask = llg_numpy.allocate_token_bitmask(1, vocab_size)
        llg_numpy.fill_next_token_bitmask(proto, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        if not proto.is_error() and len(allowed) and allowed[0] < vocab_size:
            trial = proto.deep_copy()
            if not trial.consume_token(int(allowed[0])) or trial.is_error():
                return _first_line(trial.get_error())
    return _first_line(proto.get_error()) if proto.is_error() else None


def _first_line(error: str) -> str:
    line = error.strip().splitlines()[0] if error.strip() else "rejected"
    return line if len(line) <= 300 else line[:297] + "..."


class Constraint:
    """One sequence's matcher. `waiting_for`: the token that ends the model's reasoning,
    when the constraint applies only to the answer after it (None: it applies now)."""

    __slots__ = ("matcher", "waiting_for")

    def __init__(self, matcher: llguidance.LLMatcher, waiting_for: int | None) -> None:
        self.matcher = matcher
        self.waiting_for = waiting_for


class StructuredOutputs:
    """The constraints of an engine's running sequences: compiled at `add` (before the
    request is queued), advanced by every resolved token (`accept`), asked for each step's
    bitmask (`bitmask`)."""

    def __init__(self, grammars: Grammars, reasoning_end: int | None = None) -> None:
        self.grammars = grammars
        self.reasoning_end = reasoning_end  # `</think>`'s id with a reasoning parser
        self.by_seq: dict[int, Constraint] = {}
        self._executor: llguidance.LLExecutor | None = None

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        return self.grammars.compile(params)

    def add(self, seq: Sequence, matcher: llguidance.LLMatcher) -> None:
        """`seq` is constrained by `matcher` (a copy per completion); with a reasoning
        parser, from the end of its reasoning on, unless its prompt already closed it."""
        wait = self.reasoning_end
        if wait is not None and _closes_reasoning(seq.token_ids, wait):
            wait = None
        self.by_seq[seq.seq_id] = Constraint(matcher, wait)

    def drop(self, seq_id: int) -> None:
        self.by_seq.pop(seq_id, None)

    def constrains(self, seqs: list[Sequence]) -> bool:
        by_seq = self.by_seq
        return bool(by_seq) and any(s.seq_id in by_seq for s in seqs)

    def accept(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """Advance `seq`'s matcher by its new token. STOP when the constraint is complete and
        allows no further token; ERROR when the matcher failed (a mask that ran past its
        fuel in LIMITS, or a token it did not allow): the output would not conform."""
        c = self.by_seq.get(seq.seq_id)
        if c is None:
            return None
        if c.waiting_for is not None:
            if token_id == c.waiting_for:
                c.waiting_for = None
            return None
        if not c.matcher.consume_token(token_id) or c.matcher.is_error():
            log.warning("sequence %d ends: its constraint failed at token %d (%s)",
                        seq.seq_id, token_id, _first_line(c.matcher.get_error()))
            self.by_seq.pop(seq.seq_id)
            return FinishReason.ERROR
        return FinishReason.STOP if c.matcher.is_stopped() else None

    def bitmask(self, seqs: list[Sequence]) -> np.ndarray | None:
        """Allowed tokens of each row (int32 [rows, ceil(V / 32)], bit i of word j: token
        32 j + i); every bit set for a row without an active constraint. None when no row
        has one now."""
        rows = []
        for i, seq in enumerate(seqs):
            c = self.by_seq.get(seq.seq_id)
            if c is not None and c.waiting_for is None and not seq.is_finished:
                rows.append((c.matcher, i))
        if not rows:
            return None
        mask = llg_numpy.allocate_token_bitmask(len(seqs), self.grammars.vocab_size)
        if len(rows) == 1:
            llg_numpy.fill_next_token_bitmask(rows[0][0], mask, rows[0][1])
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llg_numpy.fill_next_token_bitmask_par(self._executor, rows, mask)
        return mask


def _closes_reasoning(prompt: list[int], end_id: int, tail: int = 3) -> bool:
    # a template that turns thinking off ends the prompt with an empty <think></think> (and
    # a newline); an earlier turn's reasoning is further back than the next turn's header
    return end_id in prompt[-tail:]
