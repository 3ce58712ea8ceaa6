"""A Generation's answer to the client: server-sent events as Deltas arrive, or one JSON body
once every completion has ended (aborted if the client hangs up first)."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanovllm.entrypoints.openai.errors import api_error
from nanovllm.entrypoints.openai.generation import Generation
from nanovllm.entrypoints.openai.shapes import ResponseShape

log = logging.getLogger("nanovllm.server")


async def respond(request: Request, gen: Generation, shape: ResponseShape) -> Response:
    """Start `gen` in the engine and answer with its stream or its collected body."""
    await gen.start()
    if gen.req.stream:
        return ClosingStream(sse_events(gen, shape), gen)
    collect = asyncio.ensure_future(gen.collect())
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (gone, collect):  # no-op once done; wait for the cancellations to land
            task.cancel()
        await asyncio.gather(gone, collect, return_exceptions=True)
        gen.close()  # aborts what the client no longer waits for
    if collect.cancelled():
        return Response(status_code=499)  # the client has gone: nobody reads this
    collect.result()  # raises what collecting raised
    choices = [
        shape.choice(i, "".join(c.text), c.logprobs, c.finish_reason, c.stop_reason)
        for i, c in enumerate(gen.choices)
    ]
    return JSONResponse({**gen.header(shape.obj), "choices": choices, "usage": gen.usage()})


class ClosingStream(StreamingResponse):
    """A Generation's event stream that closes it however the response ends: streamed to
    its end, the client gone (before the first chunk too), or the response's task cancelled
    (a stop's drain timing out), which skips a background task: what has not finished is
    aborted in the engine and logged."""

    def __init__(self, events: AsyncIterator[str], gen: Generation) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close()


async def sse_events(gen: Generation, shape: ResponseShape) -> AsyncIterator[str]:
    """`gen`'s chunks as server-sent events, one write per batch of Deltas, then [DONE]; an
    error after the response has started is reported in the stream."""
    usage = gen.req.include_usage

    # the same id, time and model open every chunk: encoded once, as the text before the
    # choices (encoding JSON is a large part of the front end's work a token)
    dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
    opening = f"data: {dumps(gen.header(shape.chunk_obj))[:-1]},\"choices\":"

    def event(choices: list[dict], usage_: dict | None = None) -> str:
        if usage:  # OpenAI: null in every chunk but the last
            return f"{opening}{dumps(choices)},\"usage\":{dumps(usage_)}}}\n\n"
        return f"{opening}{dumps(choices)}}}\n\n"

    try:
        for choice in shape.opening(len(gen.choices)):
            yield event([choice])
        async for batch in gen.delta_batches():
            events = []
            for i, d in batch:
                if d.text or d.logprobs or d.finish_reason:  # not a character still incomplete
                    entries = list(zip(d.token_ids, d.logprobs or ()))
                    args = (i, d.text, entries, d.finish_reason, d.stop_reason)
                    events.append(event([shape.choice(*args, delta=True)]))
            if events:
                yield "".join(events)  # one write for the whole batch
        if usage:
            yield event([], gen.usage())
    except Exception as e:  # the response has started: report the error in the stream
        err = api_error(e)
        if err.status == 500:
            log.exception("error while streaming %s", gen.id)
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        gen.close()
    yield "data: [DONE]\n\n"


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
