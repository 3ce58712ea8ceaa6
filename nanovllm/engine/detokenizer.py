"""Streaming detokenization: the text each step adds, never half a character."""

from __future__ import annotations

import os

from nanovllm.engine.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text pieces whose concatenation is exactly
    `tokenizer.decode(output_ids)` once `flush()` has been called.

    Each step decodes a short window of recent ids twice, without and with the new ones, and
    emits the difference: a window, not one id at a time, keeps what a token means in context
    (byte-level pieces of one character, a sentencepiece leading space). Text that ends in U+FFFD
    is held back until later ids complete the character.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        # The prompt is deliberately not decoding context: the stream must equal the decode of
        # the output ids alone, which drops e.g. a leading sentencepiece space the prompt keeps.
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.output_ids: list[int] = []
        self.output_text = ""
        self._prefix_offset = 0  # the window starts here: ids already emitted, kept as context
        self._read_offset = 0  # ids before this are emitted

    def step(self, new_token_ids: list[int]) -> str:
        """Append ids; return the text they finish ("" while a character is incomplete)."""
        self.output_ids.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of a sequence, emit what is held back (bytes that never formed a
        character, or a literal U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        ids = self.output_ids
        if self._read_offset == len(ids):
            return ""
        skip = self.skip_special_tokens
        window = ids[self._prefix_offset :]
        prefix = self.tokenizer.decode(window[: self._read_offset - self._prefix_offset], skip)
        text = self.tokenizer.decode(window, skip)
        # nothing new (a skipped special token) or an unfinished character: wait for more ids
        if not final and (len(text) <= len(prefix) or text.endswith(_REPLACEMENT)):
            return ""
        if text.startswith(prefix):  # always, for byte-level BPE and sentencepiece decoders
            new_text = text[len(prefix) :]
        else:  # a decoder that rewrites text across ids: emit past what both agree on
            new_text = text[len(os.path.commonprefix([prefix, text])) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self.output_text += new_text
        return new_text
