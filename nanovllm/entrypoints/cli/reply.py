"""One reply in the terminal: fit the default --max-tokens to the context, stream the text,
stop cleanly on Ctrl-C, and say on stderr why the output ended when it was cut short."""

import dataclasses
import logging
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from nanovllm.core.sampling_params import SamplingParams

log = logging.getLogger("nanovllm.cli")


def fit_to_context(
    engine, prompt: str | list[int], params: SamplingParams, explicit: bool
) -> tuple[list[int], SamplingParams]:
    """The prompt's token ids and the params to run it with. An `explicit` --max-tokens
    must fit beside the prompt (the engine's check raises InvalidRequestError); a default
    is not the user's request, so it shrinks to the room the context leaves."""
    if explicit:
        return engine.tokenize_prompt(prompt, params), params
    ids = engine.tokenize_prompt(prompt)
    room = engine.max_model_len - len(ids)
    if params.max_tokens > room:
        params = dataclasses.replace(params, max_tokens=room)
    return ids, params


def stream_reply(engine, ids: list[int], params: SamplingParams, explicit: bool) -> str:
    """Generate a reply to `ids`, printing it as it comes and ending the line; returns it.
    Ctrl-C stops it after the current step (the engine stays usable) and raises
    KeyboardInterrupt; a second Ctrl-C raises at once."""
    start = time.perf_counter()
    request_id = engine.add_request(ids, params, stream=True, delta=True)
    text, num_tokens, reason = "", 0, None
    with _interrupt_between_steps() as pressed:
        try:
            while engine.has_unfinished_requests() and not pressed:
                for out in engine.step():
                    for c in out.outputs if out.request_id == request_id else ():
                        sys.stdout.write(c.text)
                        sys.stdout.flush()
                        text, num_tokens = text + c.text, num_tokens + len(c.token_ids)
                        reason = c.finish_reason or reason
        finally:
            engine.abort_request(request_id)  # False once it has finished
            if text and not text.endswith("\n"):
                sys.stdout.write("\n")
            sys.stdout.flush()
        if pressed:
            raise KeyboardInterrupt
    seconds = time.perf_counter() - start
    log.info("%d prompt tokens, %d generated in %.2f s (%.1f tokens/s)",
             len(ids), num_tokens, seconds, num_tokens / seconds)
    if reason not in ("stop", None):
        why = _why(reason, len(ids) + num_tokens, engine.max_model_len, params, explicit)
        print(f"[stopped: {why}]", file=sys.stderr)
    return text


def _why(reason: str, length: int, max_model_len: int, params: SamplingParams,
         explicit: bool) -> str:
    if reason != "length":
        return reason
    if length >= max_model_len:
        return f"the context of {max_model_len} tokens is full"
    default = "" if explicit else ", the default"
    return f"reached --max-tokens {params.max_tokens}{default}"


@contextmanager
def _interrupt_between_steps() -> Iterator[list[bool]]:
    """While generating, Ctrl-C is noted (the yielded list becomes true) rather than raised
    inside engine.step(), which could leave the engine half-updated for the next reply."""

    def on_sigint(signum, frame) -> None:
        if pressed:  # pressed twice: the user does not want to wait for the step
            raise KeyboardInterrupt
        pressed.append(True)

    pressed: list[bool] = []
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)
