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


# (param, refused value, its accepted neighbour, the whole message after "param=value is invalid: ")
BOUNDS = [
    ("n", 0, 1, "use an integer >= 1"),
    ("n", 1.0, 2, "use an integer >= 1"),
    ("temperature", -0.01, 0.0, "use 0 for greedy or a positive value"),
    ("top_k", -2, -1, "use 0 or -1 to disable, or a positive integer"),
    ("top_k", 2.0, 2, "use 0 or -1 to disable, or a positive integer"),
    ("top_p", 0.0, 1e-6, "use a value in (0, 1]"),
    ("top_p", 1.0001, 1.0, "use a value in (0, 1]"),
    ("min_p", -1e-6, 0.0, "use a value in [0, 1]"),
    ("min_p", 1.0001, 1.0, "use a value in [0, 1]"),
    ("max_tokens", 0, 1, "use an integer >= 1"),
    ("max_tokens", 3.0, 3, "use an integer >= 1"),
    ("min_tokens", -1, 0, "use an integer >= 0"),
    ("min_tokens", 1.0, 1, "use an integer >= 0"),
    ("repetition_penalty", 0.0, 1e-6, "use a positive value (1.0 disables it)"),
    ("presence_penalty", -2.0001, -2.0, "use a value in [-2, 2]"),
    ("presence_penalty", 2.0001, 2.0, "use a value in [-2, 2]"),
    ("frequency_penalty", -2.0001, -2.0, "use a value in [-2, 2]"),
    ("frequency_penalty", 2.0001, 2.0, "use a value in [-2, 2]"),
    ("logprobs", -1, 0, "use a non-negative integer (top-N logprobs per token)"),
    ("logprobs", 1.0, 1, "use a non-negative integer (top-N logprobs per token)"),
    ("seed", 1.0, 1, "use an integer"),
    ("stop_token_ids", [-1], [0], "use non-negative token ids"),
    ("stop_token_ids", ["7"], [7], "use non-negative token ids"),
    ("stop", [""], ["a"], "use non-empty strings"),
    ("stop", ["a", 3], ["a", "3"], "use non-empty strings"),
]


@pytest.mark.parametrize("param, refused, accepted, why", BOUNDS,
                         ids=[f"{b[0]}={b[1]!r}" for b in BOUNDS])
def test_each_bound_refuses_exactly_its_side(param, refused, accepted, why):
    SamplingParams(**{param: accepted})  # the neighbour on the accepted side
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{param: refused})
    assert e.value.param == param
    assert str(e.value) == f"{param}={refused!r} is invalid: {why}"


def test_floats_messages_in_full():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(top_p=math.nan)
    assert str(e.value) == "top_p=nan is invalid: use a finite number"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(temperature=True)  # a bool is not a number here
    assert str(e.value) == "temperature=True is invalid: use a number"


def test_min_tokens_may_not_exceed_max_tokens():
    SamplingParams(min_tokens=5, max_tokens=5)
    SamplingParams(min_tokens=50, max_tokens=None)
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(min_tokens=6, max_tokens=5)
    assert e.value.param == "min_tokens"
    assert str(e.value) == "min_tokens=6 is invalid: it must not exceed max_tokens=5"


def test_long_values_are_shortened_in_messages():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop_token_ids=list(range(1000, 1000 + MAX_STOP_TOKEN_IDS + 1)))
    value = repr(list(range(1000, 1000 + MAX_STOP_TOKEN_IDS + 1)))
    assert str(e.value) == (f"stop_token_ids={value[:57]}... is invalid: use at most "
                            f"{MAX_STOP_TOKEN_IDS} ids, not {MAX_STOP_TOKEN_IDS + 1}")
    for k, shortened in ((52, False), (53, True)):  # repr of ["x"*k, ""] is k + 8 characters
        value = repr(["x" * k, ""])
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(stop=["x" * k, ""])
        shown = value[:57] + "..." if shortened else value
        assert str(e.value) == f"stop={shown} is invalid: use non-empty strings"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])
    assert str(e.value).endswith(f"a stop string has {MAX_STOP_STRING_CHARS + 1} characters; "
                                 f"use at most {MAX_STOP_STRING_CHARS}")
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    assert str(e.value).endswith(f"use at most {MAX_STOP_STRINGS} stop strings, "
                                 f"not {MAX_STOP_STRINGS + 1}")


def test_wrong_container_types_say_what_to_send():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop=5)
    assert str(e.value) == "stop must be a string or a list of strings"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop_token_ids=7)
    assert str(e.value) == "stop_token_ids must be a list of ids"


def test_normalised_fields():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="ab").stop_list == ["ab"]
    assert SamplingParams(stop=("a", "b")).stop_list == ["a", "b"]
    assert SamplingParams().stop_list == [] and SamplingParams().stop_token_ids == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize("kwargs, plain", [
    (dict(), True),
    (dict(temperature=0.0), True),
    (dict(temperature=0.7), True),
    (dict(top_k=5), False),
    (dict(top_k=5, temperature=0.0), True),  # greedy ignores the filters and the seed
    (dict(top_p=0.9), False),
    (dict(top_p=0.9, temperature=0.0), True),
    (dict(min_p=0.1), False),
    (dict(min_p=0.1, temperature=0.0), True),
    (dict(seed=3), False),
    (dict(seed=3, temperature=0.0), True),
    (dict(repetition_penalty=1.1), False),
    (dict(repetition_penalty=1.1, temperature=0.0), False),  # penalties change greedy too
    (dict(presence_penalty=0.5), False),
    (dict(frequency_penalty=-0.5), False),
    (dict(min_tokens=1), False),
    (dict(logprobs=0), False),
    (dict(stop=["x"], stop_token_ids=[3], n=2), True),  # stop conditions are not sampling
])
def test_plain_means_temperature_alone_decides(kwargs, plain):
    sp = SamplingParams(**kwargs)
    assert sp.plain is plain
    assert sp.greedy is (sp.temperature == 0.0)
    assert sp.uses_penalties is any(
        k in kwargs for k in ("repetition_penalty", "presence_penalty", "frequency_penalty"))
