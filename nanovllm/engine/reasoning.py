"""Splitting a reasoning model's `<think>...</think>` from its answer, whole or as it streams,
so the OpenAI server and `LLM.chat` return `reasoning_content` and `content` apart."""

from __future__ import annotations

from nanovllm.core.config import REASONING_PARSERS


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`: characters a
    stream holds back because the next piece may complete the tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """One model family's reasoning format.

    qwen3: the output is reasoning only when it opens with `<think>` (after any whitespace);
    otherwise it is all answer. deepseek_r1: the chat template already wrote `<think>` into the
    prompt, so the output is reasoning up to `</think>` whether or not it repeats the tag.
    Either way, an output cut before `</think>` is all reasoning and has no content, and the
    newlines the model writes after `</think>` are not part of the content.
    """

    start = "<think>"
    end = "</think>"

    def __init__(self, kind: str) -> None:
        if kind not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {kind!r}; choose one of {', '.join(REASONING_PARSERS)}"
            )
        self.kind = kind

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for a part that is absent or empty.
        The whole output is one piece of a stream: one way to read it, however it comes."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None

    def stream(self) -> ReasoningStream:
        """A splitter for one output that arrives in pieces."""
        return ReasoningStream(self)

    def reasoning_end_token(self, tokenizer_vocab: dict[str, int]) -> int | None:
        """The id of `</think>` when the vocabulary holds it as one token, else None: where
        a grammar constraint on the answer can start."""
        return tokenizer_vocab.get(self.end)


class ReasoningStream:
    """`split` one piece at a time. The reasoning pieces joined are `split`'s reasoning and
    the content pieces joined its content ("" for None), however the output is cut: text that
    may be the beginning of a tag waits for the next piece, or for `finish`."""

    _HEAD, _REASONING, _CONTENT = range(3)

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._state = self._HEAD
        self._held = ""  # text not yet known to be reasoning or content
        self._strip_newlines = False  # just after `</think>`: newlines there are dropped

    @property
    def ended(self) -> bool:
        """True once `</think>` has been seen, or qwen3's output is known to have no reasoning:
        everything from here on is content."""
        return self._state == self._CONTENT

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) that this piece makes certain."""
        text, self._held = self._held + delta, ""
        start = self._parser.start
        if self._state == self._HEAD:
            head = text.lstrip()
            if head.startswith(start):
                text = head[len(start) :]
                self._state = self._REASONING
            elif start.startswith(head):  # whitespace, or `<think>` maybe cut: wait
                self._held = text
                return "", ""
            else:
                self._no_start_tag()
        if self._state == self._REASONING:
            reasoning, tag, rest = text.partition(self._parser.end)
            if not tag:
                keep = _partial_tag(text, self._parser.end)
                self._held = text[len(text) - keep :]
                return text[: len(text) - keep], ""
            self._state, self._strip_newlines = self._CONTENT, True
            return reasoning, self._content(rest)
        return "", self._content(text)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held back, at the end of the output."""
        text, self._held = self._held, ""
        if self._state == self._HEAD:  # never became `<think>`
            self._no_start_tag()
        if self._state == self._REASONING:
            return text, ""  # the end of a reasoning cut off, or a cut-off `</think>`
        return "", self._content(text)

    def _no_start_tag(self) -> None:
        self._state = self._CONTENT if self._parser.kind == "qwen3" else self._REASONING

    def _content(self, text: str) -> str:
        if self._strip_newlines:
            text = text.lstrip("\n")
            self._strip_newlines = not text
        return text
