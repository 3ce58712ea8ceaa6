import json
import math
from dataclasses import dataclass, field
from functools import cached_property

from nanovllm.core.errors import InvalidRequestError

# Stop conditions are checked every step for every sequence, so their size is bounded
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# these must be finite: NaN compares false with every bound and would pass the range checks
_FLOAT_PARAMS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty",
)


# a constraint is compiled before its request is queued: its source is bounded, as is the
# grammar engine's work on it (engine/structured_output.py)
MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_CHOICES = 1024
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names): set exactly one of `json` (a JSON
    schema, as a dict or its text), `json_object=True` (any JSON object), `regex`, `choice`
    (the output is one of these strings) or `grammar` (a Lark grammar, llguidance's dialect;
    GBNF is accepted too). The output ends with finish_reason "stop" once the constraint
    is complete and allows no more tokens. `disable_any_whitespace`: JSON without
    whitespace between tokens."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    # the field errors name: "structured_outputs" (then ".json", ".regex", ...), or the
    # front end's own whole field ("response_format.json_schema", "tool_choice")
    param: str = field(default="structured_outputs", repr=False, compare=False)

    def field_name(self, kind: str | None = None) -> str:
        if self.param != "structured_outputs":
            return self.param
        return f"{self.param}.{kind or self.kind}"

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise InvalidRequestError(f"{self.field_name(name)} is invalid: {why}",
                                      param=self.field_name(name))

        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"{self.param}: set exactly one of {', '.join(_KINDS)} (got "
                f"{', '.join(given) or 'none'})", param=self.param)
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    bad("json", f"the schema is not valid JSON ({e})")
            if not isinstance(value, dict | bool):
                bad("json", "use a JSON schema object")
        elif kind == "json_object":
            if value is not True:
                bad("json_object", "use true")
        elif kind == "choice":
            if (not isinstance(value, list | tuple) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                bad("choice", "use a non-empty list of non-empty strings")
            if len(value) > MAX_CHOICES:
                bad("choice", f"use at most {MAX_CHOICES} choices, not {len(value)}")
        elif not isinstance(value, str) or not value:
            bad(kind, "use a non-empty string")
        size = len(self.key[1])
        if size > MAX_CONSTRAINT_CHARS:
            bad(kind, f"it is {size} characters; use at most {MAX_CONSTRAINT_CHARS}")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @cached_property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): what compiled constraints are cached by (computed once:
        the cache asks for it on every request)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = json.loads(value) if isinstance(value, str) else value
            text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            text = json.dumps(list(value))
        elif kind == "json_object":
            text = ""
        else:
            text = value
        if self.disable_any_whitespace:
            kind += "/compact"
        return kind, text


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, per request (same names as vLLM).

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 and min_p 0 disable
    those filters. A seed makes sampling reproducible whatever else is in the batch.
    Every float is finite; at most MAX_STOP_STRINGS stop strings of at most
    MAX_STOP_STRING_CHARS characters each, and at most MAX_STOP_TOKEN_IDS stop token ids.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    stop_list: list[str] = field(init=False, repr=False)
    # temperature (or greedy) alone decides the token: no filters, seeds, penalties,
    # min_tokens or logprobs (the GPU then samples in one pass, after any structured-output
    # mask; set at construction)
    plain: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        elif isinstance(self.stop, list | tuple | None):
            self.stop_list = list(self.stop or [])
        else:
            raise InvalidRequestError("stop must be a string or a list of strings", "stop")
        if not isinstance(self.stop_token_ids, list | tuple | None):
            raise InvalidRequestError("stop_token_ids must be a list of ids", "stop_token_ids")
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        self.plain = (
            (self.top_k == 0 or self.greedy) and (self.top_p == 1.0 or self.greedy)
            and (self.min_p == 0.0 or self.greedy) and (self.seed is None or self.greedy)
            and not self.uses_penalties and self.min_tokens == 0 and self.logprobs is None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def _validate(self) -> None:
        def bad(param: str, why: str) -> None:
            value = repr(getattr(self, param))
            value = value if len(value) <= 60 else value[:57] + "..."
            raise InvalidRequestError(f"{param}={value} is invalid: {why}", param=param)

        for name in _FLOAT_PARAMS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                bad(name, "use a number")
            if not math.isfinite(value):
                bad(name, "use a finite number")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "use an integer >= 1")
        if self.temperature < 0:
            bad("temperature", "use 0 for greedy or a positive value")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "use 0 or -1 to disable, or a positive integer")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "use a value in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "use a value in [0, 1]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            bad("max_tokens", "use an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "use an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"it must not exceed max_tokens={self.max_tokens}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "use a positive value (1.0 disables it)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "use a value in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "use a value in [-2, 2]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", "use a non-negative integer (top-N logprobs per token)")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "use a StructuredOutputsParams")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "use an integer")
        if any(not isinstance(s, str) or not s for s in self.stop_list):
            bad("stop", "use non-empty strings")
        if len(self.stop_list) > MAX_STOP_STRINGS:
            bad("stop", f"use at most {MAX_STOP_STRINGS} stop strings, not {len(self.stop_list)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop_list):
            longest = max(len(s) for s in self.stop_list)
            bad("stop", f"a stop string has {longest} characters; use at most "
                f"{MAX_STOP_STRING_CHARS}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "use non-negative token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"use at most {MAX_STOP_TOKEN_IDS} ids, not "
                f"{len(self.stop_token_ids)}")
