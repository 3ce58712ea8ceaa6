"""SamplingParams refuses what no sampler can use, for every entry point (Python API, CLI,
server): non-finite floats, and stop conditions beyond their limits."""

import math

import pytest

from nanovllm.core.errors import InvalidRequestError
from nanovllm.core.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)

FLOATS = [
    "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty",
]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("param", FLOATS)
def test_non_finite_floats_are_refused(param, value):
    with pytest.raises(InvalidRequestError, match="finite") as e:
        SamplingParams(**{param: value})
    assert e.value.param == param and param in str(e.value)


@pytest.mark.parametrize("param", FLOATS)
def test_floats_must_be_numbers(param):
    with pytest.raises(InvalidRequestError, match="number") as e:
        SamplingParams(**{param: "0.5"})
    assert e.value.param == param


def test_stop_string_limits():
    SamplingParams(stop=["s"] * MAX_STOP_STRINGS)
    SamplingParams(stop="x" * MAX_STOP_STRING_CHARS)
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_STRINGS}") as e:
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    assert e.value.param == "stop"
    assert len(str(e.value)) < 200, "the message quotes a shortened value"
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_STRING_CHARS}") as e:
        SamplingParams(stop=["ok", "x" * (MAX_STOP_STRING_CHARS + 1)])
    assert e.value.param == "stop" and len(str(e.value)) < 200


def test_stop_token_id_limit():
    SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_TOKEN_IDS}") as e:
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    assert e.value.param == "stop_token_ids"


@pytest.mark.parametrize("kwargs, param", [(dict(stop=5), "stop"),
                                           (dict(stop_token_ids=7), "stop_token_ids")])
def test_stop_of_the_wrong_type(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
