"""The one prompt check of every entry point: what it refuses, at each boundary, and what
its errors carry (param and code) for the server to report."""

import pytest

from nanovllm.core.errors import InvalidRequestError
from nanovllm.core.validation import CONTEXT_LENGTH_EXCEEDED, as_token_ids, check_prompt

VOCAB, CONTEXT = 100, 10


def test_as_token_ids():
    assert as_token_ids([1, 2]) == [1, 2] and as_token_ids((3,)) == [3]
    assert as_token_ids([]) == []
    for bad in ("12", [1, 2.0], [True], 7, None, [[1]]):
        with pytest.raises(InvalidRequestError, match="string or a list of token ids") as e:
            as_token_ids(bad, "prompt_token_ids")
        assert e.value.param == "prompt_token_ids"


def test_vocabulary_bounds():
    check_prompt([0, VOCAB - 1], VOCAB, CONTEXT)
    for bad in (-1, VOCAB):
        with pytest.raises(InvalidRequestError, match=f"token id {bad} is outside") as e:
            check_prompt([5, bad, 6], VOCAB, CONTEXT)
        assert e.value.param == "prompt" and e.value.code is None
    with pytest.raises(InvalidRequestError, match=r"\[0, 100\)"):
        check_prompt([VOCAB + 5], VOCAB, CONTEXT, param="messages")


def test_empty_prompt():
    with pytest.raises(InvalidRequestError, match="empty") as e:
        check_prompt([], VOCAB, CONTEXT, param="messages")
    assert e.value.param == "messages"


def test_context_length_boundaries():
    check_prompt([1] * (CONTEXT - 1), VOCAB, CONTEXT)  # one token of room: fine
    with pytest.raises(InvalidRequestError, match="at most 9 tokens") as e:
        check_prompt([1] * CONTEXT, VOCAB, CONTEXT)
    assert e.value.code == CONTEXT_LENGTH_EXCEEDED and e.value.param == "prompt"
    assert "has 10 tokens" in str(e.value)


def test_max_tokens_must_fit_beside_the_prompt():
    check_prompt([1] * 4, VOCAB, CONTEXT, max_tokens=6)  # exactly the context
    check_prompt([1] * 4, VOCAB, CONTEXT, max_tokens=None)
    with pytest.raises(InvalidRequestError, match="lower max_tokens to at most 6") as e:
        check_prompt([1] * 4, VOCAB, CONTEXT, max_tokens=7)
    assert e.value.param == "max_tokens" and e.value.code == CONTEXT_LENGTH_EXCEEDED
    assert "has 4 tokens and max_tokens is 7" in str(e.value)


def test_messages_name_the_first_bad_id_and_the_type():
    check_prompt([0], VOCAB, CONTEXT)  # id 0 is a token like any other
    with pytest.raises(InvalidRequestError) as e:
        check_prompt([0, -1, VOCAB], VOCAB, CONTEXT)
    assert str(e.value) == "prompt token id -1 is outside the vocabulary [0, 100)"
    with pytest.raises(InvalidRequestError) as e:
        check_prompt([], VOCAB, CONTEXT)
    assert str(e.value) == "the prompt is empty; give at least one token"
    with pytest.raises(InvalidRequestError) as e:
        as_token_ids({"a": 1})
    assert str(e.value) == "a prompt must be a string or a list of token ids, not dict"
    assert e.value.param == "prompt"
