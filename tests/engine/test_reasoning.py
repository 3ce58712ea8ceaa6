"""Reasoning split (nanovllm/engine/reasoning.py): `<think>...</think>` apart from the answer
for qwen3 (reasoning only when the output opens with `<think>`) and deepseek_r1 (the prompt
opened it: reasoning up to `</think>`), whole and streamed, the stream agreeing with the
whole split however the output is cut."""

import itertools
import random

import pytest

from nanovllm.engine.reasoning import REASONING_PARSERS, ReasoningParser

SPLIT_CASES = [
    # (kind, output, reasoning, content)
    ("qwen3", "Just the answer.", None, "Just the answer."),
    ("qwen3", "", None, None),
    ("qwen3", "<think>Let me see.</think>The answer.", "Let me see.", "The answer."),
    ("qwen3", "<think>\nhmm\n</think>\n\nThe answer.\n", "\nhmm\n", "The answer.\n"),
    ("qwen3", "<think>cut before the end", "cut before the end", None),
    ("qwen3", "<think>cut in the tag </thi", "cut in the tag </thi", None),
    ("qwen3", "  \n<think>a</think>b", "a", "b"),
    ("qwen3", "<think></think>\n\nb", None, "b"),
    ("qwen3", "<think>a</think>\n\n", "a", None),
    ("qwen3", "<think>a</think> b", "a", " b"),  # only newlines are dropped
    ("qwen3", "<think>a</think>b</think>c", "a", "b</think>c"),
    ("qwen3", "No <think> here</think>", None, "No <think> here</think>"),
    ("qwen3", "  plain", None, "  plain"),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "<think>", None, None),
    ("deepseek_r1", "Let me see.</think>The answer.", "Let me see.", "The answer."),
    ("deepseek_r1", "<think>Let me see.</think>\n\nThe answer.", "Let me see.", "The answer."),
    ("deepseek_r1", "  <think>a</think>b", "a", "b"),
    ("deepseek_r1", "no end tag", "no end tag", None),
    ("deepseek_r1", "<think>cut", "cut", None),
    ("deepseek_r1", "</think>\nonly the answer", None, "only the answer"),
    ("deepseek_r1", "  a</think>b", "  a", "b"),
    ("deepseek_r1", "a</think>\n\n\n", "a", None),
    ("deepseek_r1", "", None, None),
    ("deepseek_r1", "思考</think>答え", "思考", "答え"),
]


@pytest.mark.parametrize("kind, text, reasoning, content", SPLIT_CASES)
def test_split(kind, text, reasoning, content):
    assert ReasoningParser(kind).split(text) == (reasoning, content)


def streamed(parser, pieces):
    stream = parser.stream()
    reasoning, content = [], []
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = stream.finish()
    return "".join(reasoning + [r]), "".join(content + [c])


def cuts(text, rng):
    """Every way to cut `text` in two, in three when it is short, one character a piece,
    and random cuts into many pieces."""
    n = len(text)
    yield [text]
    yield list(text)
    for i in range(n + 1):
        yield [text[:i], text[i:]]
    if n <= 40:
        for i, j in itertools.combinations(range(1, n), 2):
            yield [text[:i], text[i:j], text[j:]]
    for _ in range(20):
        points = sorted(rng.sample(range(n + 1), min(n + 1, rng.randint(2, 10))))
        yield [text[a:b] for a, b in zip([0] + points, points + [n])]


MORE = [" ", "\n\n", "<", "</think>", "<think>\n\n</think>", " <th", "<think>a</thin", "x</"]


@pytest.mark.parametrize("kind", REASONING_PARSERS)
def test_stream_matches_split_however_cut(kind):
    parser = ReasoningParser(kind)
    rng = random.Random(0)
    for text in [case[1] for case in SPLIT_CASES] + MORE:
        reasoning, content = parser.split(text)
        want = (reasoning or "", content or "")
        for pieces in cuts(text, rng):
            assert streamed(parser, pieces) == want, (text, pieces)


def test_stream_gives_text_as_soon_as_it_is_certain():
    stream = ReasoningParser("qwen3").stream()
    assert stream.feed("  <thi") == ("", "")  # may be `<think>`: held
    assert stream.feed("nk>Hmm, ") == ("Hmm, ", "")
    assert stream.feed("yes</th") == ("yes", "")  # may be `</think>`: held
    assert not stream.ended
    assert stream.feed("ink>\n") == ("", "")
    assert stream.ended
    assert stream.feed("\nIt is 4.") == ("", "It is 4.")
    assert stream.finish() == ("", "")
    stream = ReasoningParser("qwen3").stream()
    assert stream.feed("Hi") == ("", "Hi") and stream.ended  # no `<think>`: all answer
    stream = ReasoningParser("deepseek_r1").stream()
    assert stream.feed("Hi") == ("Hi", "") and not stream.ended  # the prompt opened it
    assert stream.feed("</think>") == ("", "") and stream.ended
    assert stream.finish() == ("", "")


def test_ended_at_finish():
    stream = ReasoningParser("qwen3").stream()
    assert stream.feed(" ") == ("", "") and not stream.ended
    assert stream.finish() == ("", " ")
    assert stream.ended  # never opened: it was all answer
    stream = ReasoningParser("deepseek_r1").stream()
    stream.feed("cut off")
    assert stream.finish() == ("", "")
    assert not stream.ended


def test_unknown_kind():
    assert REASONING_PARSERS == ("qwen3", "deepseek_r1")
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'; choose one of qwen3, "
                       "deepseek_r1"):
        ReasoningParser("o1")


def test_reasoning_end_token():
    parser = ReasoningParser("qwen3")
    assert parser.reasoning_end_token({"<think>": 7, "</think>": 8, "a": 1}) == 8
    assert parser.reasoning_end_token({"</": 3, "think": 4, ">": 5}) is None
    assert ReasoningParser("deepseek_r1").reasoning_end_token({"</think>": 0}) == 0
