"""OutputProcessor and IncrementalDetokenizer held to independent references: the text of a
completion is the tokenizer's decode of its ids, a stop string cuts where str.find puts it,
and a delta stream adds up to the whole output (text, ids, logprobs), whatever the tokens
and the stop strings.

A small driver plays the scheduler's part (tokens arrive one step at a time, with overlap's
placeholder on the host between steps) so that these tests run in milliseconds and can be the
test selection of the mutation run (scripts/mutation.sh).
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.core.sampling_params import SamplingParams
from nanovllm.core.sequence import PLACEHOLDER, FinishReason, Sequence, SequenceStatus
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.tokenizer import Tokenizer
from tests.support import CORPUS, build_tokenizer_files

PROMPT = [5, 6, 7]
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, naïve café, 東京, 😀 emoji",  # characters of several byte-level tokens
    "Prefix caching lets requests reuse blocks. 1234567890 + - * /",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer_files(path)
    return Tokenizer.load(path)


def finish(seq: Sequence, reason: FinishReason, stop_reason=None) -> None:
    """What Scheduler.finish does to the sequence (blocks aside)."""
    if seq.token_ids[-1] == PLACEHOLDER:
        seq.token_ids.pop()
    seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason


class Driver:
    """Feeds each completion its tokens one step at a time, as the engine loop does."""

    def __init__(self, tok: Tokenizer, overlap: bool = False) -> None:
        self.proc = OutputProcessor(tok, finish)
        self.overlap = overlap
        self.seq_ids = iter(range(10**6))

    def add(self, params: SamplingParams, stream=False, delta=False, detokenize=True, n=1,
            request_id="r", prompt=None, arrival=0.0):
        seqs = [Sequence(next(self.seq_ids), PROMPT, params, arrival) for _ in range(n)]
        for s in seqs:
            s.status = SequenceStatus.RUNNING
        return self.proc.new_request(request_id, prompt, PROMPT, params, seqs, arrival, stream,
                                     delta, detokenize)

    def run(self, req, tokens: list[list[int]], logprobs=None, end=True):
        """Every step's outputs until all completions finish or run out of tokens (each
        finishes by length with its last token, unless `end` is False)."""
        outs = []
        for step in range(max(len(t) for t in tokens)):
            for i, seq in enumerate(req.seqs):
                if seq.is_finished or step >= len(tokens[i]):
                    continue
                if seq.token_ids[-1] == PLACEHOLDER:
                    seq.token_ids[-1] = tokens[i][step]
                else:
                    seq.append_token(tokens[i][step])
                if logprobs is not None:
                    seq.logprobs.append(logprobs[i][step])
                if end and step == len(tokens[i]) - 1:
                    finish(seq, FinishReason.LENGTH)
                self.proc.on_token(req, i, seq)
            for seq in req.seqs:  # overlap: the next step is launched before outputs go out
                if self.overlap and not seq.is_finished:
                    seq.append_token(PLACEHOLDER)
            outs += [out for _, out in self.proc.take() if out is not None]
        return outs


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_whole_stream_is_always_a_prefix_of_the_decode(tok, text, overlap):
    ids = ids_of(tok, text)
    d = Driver(tok, overlap)
    req = d.add(SamplingParams(max_tokens=len(ids)), stream=True)
    outs = d.run(req, [ids])
    assert len(outs) == len(ids), "a streamed request reports after every token"
    for k, out in enumerate(outs):
        assert text.startswith(out.text) and "\ufffd" not in out.text
        assert out.outputs[0].token_ids == ids[: k + 1]
        assert out.finished is (k == len(ids) - 1)
    assert outs[-1].text == tok.decode(ids) == text
    assert outs[-1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_delta_stream_adds_up_to_the_whole_output(tok, overlap):
    ids = [ids_of(tok, t) for t in TEXTS]
    lps = [[{t: -0.5 * k} for k, t in enumerate(seq_ids)] for seq_ids in ids]
    d = Driver(tok, overlap)
    req = d.add(SamplingParams(max_tokens=100, logprobs=1), stream=True, delta=True, n=3)
    outs = d.run(req, ids, lps)
    for i in range(3):
        mine = [c for o in outs for c in o.outputs if c.index == i]
        assert "".join(c.text for c in mine) == TEXTS[i]
        assert [t for c in mine for t in c.token_ids] == ids[i]
        assert [lp for c in mine for lp in c.logprobs] == lps[i]
        assert all(c.token_ids for c in mine), "a delta without a new token is not sent"
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + ["length"]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]


def test_unstreamed_request_reports_once_when_all_completions_finish(tok):
    ids = [ids_of(tok, TEXTS[0]), ids_of(tok, TEXTS[1])[:3]]  # the second ends first
    d = Driver(tok)
    req = d.add(SamplingParams(max_tokens=100), n=2)
    outs = d.run(req, ids)
    assert len(outs) == 1 and outs[0].finished
    assert [c.text for c in outs[0].outputs] == [tok.decode(i) for i in ids]
    assert [c.token_ids for c in outs[0].outputs] == ids
    assert outs[0].outputs[0].logprobs is None, "logprobs only when asked for"


def test_detokenize_false_gives_ids_without_text(tok):
    ids = ids_of(tok, TEXTS[1])
    for stream in (False, True):
        d = Driver(tok)
        req = d.add(SamplingParams(max_tokens=100), stream=stream, detokenize=False)
        outs = d.run(req, [ids])
        assert outs[-1].text == "" and outs[-1].token_ids == ids


def test_special_tokens_are_shown_only_when_asked(tok):
    end = tok.special_tokens["<|im_end|>"]
    ids = ids_of(tok, "The fox") + [end] + ids_of(tok, " ran")
    for skip, expected in ((True, "The fox ran"), (False, "The fox<|im_end|> ran")):
        for stream in (False, True):
            d = Driver(tok)
            req = d.add(SamplingParams(max_tokens=100, skip_special_tokens=skip), stream=stream)
            assert d.run(req, [ids])[-1].text == expected


def stop_reference(tok: Tokenizer, ids: list[int], stops: list[str], include: bool):
    """The text a completion keeps: decode its ids one more at a time (whole characters
    only) until some stop string appears, and cut at the earliest one then present."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        if text.endswith("\ufffd"):
            continue
        hits = sorted((text.find(s), s) for s in stops if s in text)
        if hits:
            pos, stop = hits[0]
            return (text[: pos + len(stop)] if include else text[:pos]), stop, k
    return tok.decode(ids), None, len(ids)


@settings(max_examples=150, deadline=None)
@given(
    text=st.sampled_from(TEXTS),
    spans=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 6)), min_size=1, max_size=3),
    include=st.booleans(),
    stream=st.booleans(),
    delta=st.booleans(),
    overlap=st.booleans(),
)
def test_stop_strings_cut_where_find_does(tok, text, spans, include, stream, delta, overlap):
    stops = list(dict.fromkeys(text[a : a + n] for a, n in spans if text[a : a + n]))
    if not stops:
        return
    ids = ids_of(tok, text)
    d = Driver(tok, overlap)
    sp = SamplingParams(max_tokens=len(ids), stop=stops, include_stop_str_in_output=include)
    req = d.add(sp, stream=stream, delta=delta)
    outs = d.run(req, [ids])
    expected, stop, k = stop_reference(tok, ids, stops, include)
    got = "".join(o.text for o in outs) if delta else outs[-1].text
    assert got == expected
    last = outs[-1].outputs[0]
    assert outs[-1].finished
    assert (last.finish_reason, last.stop_reason) == (("stop", stop) if stop else ("length", None))
    assert req.seqs[0].output_token_ids == ids[:k], "it stops at the token that completes it"
    if delta and stream:  # nothing shown was later cut back
        shown = ""
        for o in outs:
            shown += o.text
            assert expected.startswith(shown)


def test_min_tokens_defers_a_stop_string(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids = ids_of(tok, text)
    d = Driver(tok)
    req = d.add(SamplingParams(max_tokens=len(ids), stop=["The"], min_tokens=len(ids) - 1))
    out = d.run(req, [ids])[-1]
    # "The" completed before min_tokens: the completion runs on; the stop is not found later
    assert out.text == text and out.outputs[0].finish_reason == "length"
    d = Driver(tok)
    req = d.add(SamplingParams(max_tokens=len(ids), stop=["lazy"], min_tokens=2))
    out = d.run(req, [ids])[-1]
    assert out.text == "The quick brown fox jumps over the "
    assert out.outputs[0].stop_reason == "lazy"


def test_abort_keeps_what_a_stream_showed(tok):
    text = "The quick brown fox jumps"
    ids = ids_of(tok, text)
    d = Driver(tok)
    req = d.add(SamplingParams(max_tokens=100, stop=["fox jumps over"]), stream=True, delta=True)
    outs = d.run(req, [ids], end=False)  # no stop string yet: still running
    assert not outs[-1].finished
    shown = "".join(o.text for o in outs)
    assert text.startswith(shown) and len(shown) <= len(text) - len("fox jumps over") + 1 + 5
    seq = req.seqs[0]
    finish(seq, FinishReason.ABORT)
    d.proc.on_finish(req, 0, seq)
    final = d.proc.output(req)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert shown + final.outputs[0].text == text, "the held-back tail comes with the end"


def test_abort_of_an_unstreamed_request_decodes_what_it_has(tok):
    ids = ids_of(tok, TEXTS[1])[:7]
    d = Driver(tok)
    req = d.add(SamplingParams(max_tokens=100))
    assert d.run(req, [ids], end=False) == []
    finish(req.seqs[0], FinishReason.TIMEOUT)
    d.proc.on_finish(req, 0, req.seqs[0])
    out = d.proc.output(req)
    assert out.text == tok.decode(ids) and out.outputs[0].finish_reason == "timeout"


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(sorted(set("".join(CORPUS)))), max_size=40),
       chunks=st.lists(st.integers(1, 4), min_size=1, max_size=40))
def test_incremental_detokenizer_equals_decode(tok, text, chunks):
    ids = ids_of(tok, text)
    detok = IncrementalDetokenizer(tok)
    pieces, k = [], 0
    for n in chunks * (len(ids) + 1):
        if k >= len(ids):
            break
        piece = detok.step(ids[k : k + n])
        k += n
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.output_text == tok.decode(ids)


def test_detokenizer_flush_gives_an_unfinished_character(tok):
    ids = ids_of(tok, "😀")
    assert len(ids) > 1, "the emoji is several byte-level tokens"
    detok = IncrementalDetokenizer(tok)
    assert detok.step(ids[:1]) == ""  # a partial character is held back
    assert detok.flush() == tok.decode(ids[:1]) == "\ufffd"
    assert detok.flush() == "", "nothing twice"


def test_outputs_carry_the_request(tok):
    ids = [ids_of(tok, "The fox"), ids_of(tok, "A dog")]
    lps = [[{t: -1.0 - k} for k, t in enumerate(i)] for i in ids]
    d = Driver(tok)
    req = d.add(SamplingParams(max_tokens=100, logprobs=0), n=2, request_id="req-7",
                prompt="Say", arrival=1.0)
    assert req.arrival_time == 1.0 and req.params.logprobs == 0
    for seq in req.seqs:
        seq.first_scheduled_time, seq.num_cached_prefix_tokens = 3.5, 16
    (out,) = d.run(req, ids, lps)
    assert (out.request_id, out.prompt, out.prompt_token_ids) == ("req-7", "Say", PROMPT)
    assert out.queue_time == 2.5 and out.num_cached_tokens == 16
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.logprobs for c in out.outputs] == lps
    for delta in (False, True):  # no logprobs asked: None, not an empty list
        d = Driver(tok)
        req = d.add(SamplingParams(max_tokens=100), stream=True, delta=delta)
        outs = d.run(req, ids[:1])
        assert all(c.logprobs is None for o in outs for c in o.outputs)
        assert all(o.queue_time is None for o in outs), "not scheduled: no queue time"


def test_streamed_text_shows_special_tokens_when_asked(tok):
    end = tok.special_tokens["<|im_end|>"]
    ids = ids_of(tok, "The fox") + [end] + ids_of(tok, " ran")
    n = len(ids_of(tok, "The fox")) + 1
    for delta in (False, True):
        d = Driver(tok)
        req = d.add(SamplingParams(max_tokens=100, skip_special_tokens=False), stream=True,
                    delta=delta)
        outs = d.run(req, [ids], end=False)  # still running: texts are the stream's own
        shown = "".join(o.text for o in outs[:n]) if delta else outs[n - 1].text
        assert shown == "The fox<|im_end|>"


def test_stop_strings_act_without_detokenize(tok):
    ids = ids_of(tok, "The quick brown fox jumps")
    d = Driver(tok)
    req = d.add(SamplingParams(max_tokens=100, stop=["brown"]), detokenize=False)
    (out,) = d.run(req, [ids])
    assert out.text == "The quick " and out.outputs[0].finish_reason == "stop"


def test_delta_stream_holds_back_only_what_may_begin_a_stop(tok):
    text = "The quick brown fox jumps over the lazy dog."  # one byte per character
    ids = ids_of(tok, text)
    stops = ["zzz", "qqqqq"]  # never found; the longest has 5 characters
    d = Driver(tok)
    req = d.add(SamplingParams(max_tokens=len(ids), stop=stops), stream=True, delta=True)
    outs = d.run(req, [ids])
    shown = ""
    for k, o in enumerate(outs[:-1], 1):
        shown += o.text
        assert len(shown) == max(0, len(tok.decode(ids[:k])) - 4), k
    assert shown + outs[-1].text == text


def test_min_tokens_boundary_for_stop_strings(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids = ids_of(tok, text)
    k = next(k for k in range(1, len(ids)) if "brown" in tok.decode(ids[:k]))
    d = Driver(tok)  # the stop completes at token k, exactly min_tokens: it stops there
    req = d.add(SamplingParams(max_tokens=len(ids), stop=["brown"], min_tokens=k))
    (out,) = d.run(req, [ids])
    assert out.outputs[0].stop_reason == "brown" and len(out.token_ids) == k
    # a stop string completed before min_tokens does not end the completion later on
    boundary = tok.decode(ids[:k])
    stop = boundary[-5:]  # ends exactly where token k ends; the only (and longest) stop
    if text.count(stop) == 1:
        d = Driver(tok)
        req = d.add(SamplingParams(max_tokens=len(ids), stop=[stop], min_tokens=k + 1))
        (out,) = d.run(req, [ids])
        assert out.outputs[0].finish_reason == "length" and out.text == text


def test_the_first_occurrence_in_a_token_cuts(tok):
    for t in range(tok.vocab_size):  # a token whose text holds some character twice
        piece = tok.decode([t])
        twice = [c for c in piece if c.isalnum() and piece.count(c) > 1]
        if twice and "\ufffd" not in piece:
            break
    else:
        pytest.skip("no token repeats a character")
    d = Driver(tok)
    req = d.add(SamplingParams(max_tokens=5, stop=[twice[0]]))
    (out,) = d.run(req, [[t]])
    assert out.text == piece[: piece.index(twice[0])]


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_ending_inside_a_character_ends_as_decode_has_it(tok, stream):
    ids = ids_of(tok, "東京 😀")
    cut = ids[:-1]  # the emoji's last byte never comes
    assert tok.decode(cut).endswith("\ufffd")
    d = Driver(tok)
    req = d.add(SamplingParams(max_tokens=100, stop=["zzz"]), stream=stream)
    out = d.run(req, [cut])[-1]
    assert out.text == tok.decode(cut)
    d = Driver(tok)  # the same, ended by abort
    req = d.add(SamplingParams(max_tokens=100), stream=stream)
    d.run(req, [cut], end=False)
    finish(req.seqs[0], FinishReason.ABORT)
    d.proc.on_finish(req, 0, req.seqs[0])
    assert d.proc.output(req).text == tok.decode(cut)


def test_abort_without_detokenize_has_no_text(tok):
    d = Driver(tok)
    req = d.add(SamplingParams(max_tokens=100), stream=True, detokenize=False)
    d.run(req, [ids_of(tok, "The fox")], end=False)
    finish(req.seqs[0], FinishReason.ABORT)
    d.proc.on_finish(req, 0, req.seqs[0])
    assert d.proc.output(req).text == ""


def test_a_delta_stream_reports_completions_that_moved_past_one_that_did_not(tok):
    ids = [ids_of(tok, "The"), ids_of(tok, "The quick brown fox")]
    d = Driver(tok)
    req = d.add(SamplingParams(max_tokens=100), stream=True, delta=True, n=2)
    outs = d.run(req, ids, end=False)  # completion 0 waits (no token) while 1 goes on
    later = [c for o in outs for c in o.outputs if c.index == 1]
    assert [t for c in later for t in c.token_ids] == ids[1]
    assert "".join(c.text for c in later) == "The quick brown fox"


def test_stop_strings_make_the_engine_decode_even_when_the_caller_would(tok):
    """detokenize=False (the server decodes streams itself) does not hold for a request
    with stop strings: their text is the engine's, also when it is aborted."""
    ids = ids_of(tok, "The quick brown fox")
    d = Driver(tok)
    req = d.add(SamplingParams(max_tokens=100, stop=["zzz"]), stream=True, delta=True,
                detokenize=False)
    outs = d.run(req, [ids], end=False)
    finish(req.seqs[0], FinishReason.ABORT)
    d.proc.on_finish(req, 0, req.seqs[0])
    shown = "".join(o.text for o in outs) + d.proc.output(req).text
    assert shown == "The quick brown fox"
    d = Driver(tok)  # not streamed: the final text is decoded at the abort
    req = d.add(SamplingParams(max_tokens=100, stop=["zzz"]), detokenize=False)
    d.run(req, [ids], end=False)
    finish(req.seqs[0], FinishReason.ABORT)
    d.proc.on_finish(req, 0, req.seqs[0])
    assert d.proc.output(req).text == "The quick brown fox"
