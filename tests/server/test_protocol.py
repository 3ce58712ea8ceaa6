"""The request models publish SamplingParams' own bounds: a value at a published bound is one
SamplingParams takes, a value past it one it refuses, so /openapi.json tells clients and
fuzzers what the engine accepts."""

import pytest

from nanovllm.core.errors import InvalidRequestError
from nanovllm.core.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from nanovllm.entrypoints.openai.protocol import CompletionRequest

BOUNDED = ["n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "min_tokens", "max_tokens"]
PROPERTIES = CompletionRequest.model_json_schema()["properties"]


def _numeric(field: str) -> dict:
    schema = PROPERTIES[field]
    return next(s for s in schema.get("anyOf", [schema]) if s.get("type") != "null")


def _accepts(field: str, value: float) -> bool:
    try:
        SamplingParams(**{field: value})
    except InvalidRequestError:
        return False
    return True


@pytest.mark.parametrize("field", BOUNDED)
def test_published_bounds_are_sampling_params_bounds(field):
    schema = _numeric(field)
    step = 1 if schema["type"] == "integer" else 1e-6
    bounds = {k: v for k, v in schema.items() if k.endswith("imum")}  # (exclusive) min, max
    assert bounds, f"{field} publishes no bound"
    for key, bound in bounds.items():
        inward = step if key.lower().endswith("minimum") else -step
        if key.startswith("exclusive"):
            assert not _accepts(field, bound), f"{field}={bound} ({key})"
        else:
            assert _accepts(field, bound), f"{field}={bound} ({key})"
            assert not _accepts(field, bound - inward), f"{field}={bound - inward} ({key})"
        assert _accepts(field, bound + inward), f"{field}={bound + inward} ({key})"


def test_published_stop_limits_are_sampling_params_limits():
    stop = PROPERTIES["stop"]
    lengths = {s.get("maxLength") for s in stop["anyOf"] if s.get("type") == "string"}
    lists = [s for s in stop["anyOf"] if s.get("type") == "array"]
    assert lengths == {MAX_STOP_STRING_CHARS}
    assert lists[0]["maxItems"] == MAX_STOP_STRINGS
    assert lists[0]["items"]["maxLength"] == MAX_STOP_STRING_CHARS
    ids = next(s for s in PROPERTIES["stop_token_ids"]["anyOf"] if s.get("type") == "array")
    assert ids["maxItems"] == MAX_STOP_TOKEN_IDS and ids["items"]["minimum"] == 0
