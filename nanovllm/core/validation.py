"""Prompt checks shared by every way in (the Python API, the CLI, the server), so each
rejects the same prompts with the same message."""

from nanovllm.core.errors import InvalidRequestError

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the code a length error carries


def as_token_ids(prompt: object, param: str = "prompt") -> list[int]:
    """A prompt given as token ids, as a list; any other shape is an error."""
    # the types' set, built in C: a Python loop here cost ~45 us a 512-token prompt, paid on
    # the engine's thread for every request it takes. Exactly int: a bool is not a token id
    if isinstance(prompt, (list, tuple)) and set(map(type, prompt)) <= {int}:
        return list(prompt)
    raise InvalidRequestError(
        f"a prompt must be a string or a list of token ids, not {type(prompt).__name__}", param
    )


def check_prompt(
    ids: list[int],
    vocab_size: int,
    max_model_len: int,
    max_tokens: int | None = None,
    param: str = "prompt",
) -> None:
    """Raise InvalidRequestError unless `ids` is a prompt the engine can run: non-empty,
    inside the vocabulary, and leaving room for `max_tokens` (when set) in the context."""
    if not ids:
        raise InvalidRequestError("the prompt is empty; give at least one token", param)
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise InvalidRequestError(
            f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", param
        )
    n = len(ids)
    if n >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {n} tokens but the context (max_model_len) is {max_model_len}, "
            f"leaving no room to generate; shorten the prompt to at most {max_model_len - 1} "
            "tokens",
            param,
            CONTEXT_LENGTH_EXCEEDED,
        )
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"the prompt has {n} tokens and max_tokens is {max_tokens}, together more than "
            f"the context (max_model_len) of {max_model_len}; lower max_tokens to at most "
            f"{max_model_len - n} or shorten the prompt",
            "max_tokens",
            CONTEXT_LENGTH_EXCEEDED,
        )
