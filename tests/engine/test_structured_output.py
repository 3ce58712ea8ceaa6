"""Structured output in the Python API: every sampled completion of a random tiny model
conforms to its constraint (checked by jsonschema and re, not by the grammar engine), with
every engine feature a constrained request meets; bad constraints fail before anything is
queued and disturb nothing."""

import json
import re

import jsonschema
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.core.errors import InvalidRequestError
from nanovllm.core.sampling_params import StructuredOutputsParams
from nanovllm.engine.structured_output import Grammars, StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,4}-[0-9]{2,3}"  # \\d: any Unicode digit, as in Rust
CHOICES = ["red", "green", "blue", "dark red"]
# a Lark grammar: sums of small numbers
GRAMMAR = 'start: num (" + " num)*\nnum: /[1-9][0-9]?/\n'


def constrained(n: int = 1, max_tokens: int = 120, **kind) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, n=n,
                          structured_outputs=StructuredOutputsParams(**kind))


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=512, max_num_seqs=16)


def texts(llm, params: SamplingParams, prompts=("the cat",)) -> list:
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    return [c for o in outs for c in o.outputs]


@pytest.mark.parametrize("overlap", [False, True])
def test_json_schema_conforms_under_sampling(llm, overlap):
    llm.engine.overlap = overlap  # the CPU default is off; on, masks wait on the last step
    try:
        outs = texts(llm, constrained(n=25, json=SCHEMA, disable_any_whitespace=True),
                     ["a", "the dog"])
    finally:
        llm.engine.overlap = False
    assert len(outs) == 50
    for c in outs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in outs}) > 10  # sampled, not one forced string


def test_json_object_regex_choice_grammar(llm):
    for c in texts(llm, constrained(n=50, json_object=True, disable_any_whitespace=True,
                                    max_tokens=200)):
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:  # a random model may nest without end: a cut output is still a JSON prefix
            assert c.text.startswith("{")
    for c in texts(llm, constrained(n=50, regex=REGEX)):
        assert re.fullmatch(REGEX, c.text) and c.finish_reason == "stop"
    got = texts(llm, constrained(n=50, choice=CHOICES))
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in got)
    assert len({c.text for c in got}) > 1
    for c in texts(llm, constrained(n=50, grammar=GRAMMAR, max_tokens=40)):
        assert c.finish_reason in ("stop", "length")
        body = c.text if c.finish_reason == "stop" else c.text.rstrip(" +")
        assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?)*", body), c.text


def test_gbnf_grammar_is_accepted(llm):
    gbnf = 'root ::= "yes" | "no" | "it depends"'
    got = texts(llm, constrained(n=20, grammar=gbnf))
    assert {c.text for c in got} <= {"yes", "no", "it depends"}


def test_with_every_sampling_feature(llm):
    """Seeds, top-k/p, min-p, penalties, stop strings, logprobs and n > 1 all meet the mask;
    a seeded request is reproducible."""
    base = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.2,
                presence_penalty=0.5, frequency_penalty=0.3, logprobs=2, seed=7, n=3,
                max_tokens=60)
    so = StructuredOutputsParams(regex=r"(ab|cd|ef){2,6}")
    a = texts(llm, SamplingParams(**base, structured_outputs=so))
    b = texts(llm, SamplingParams(**base, structured_outputs=so))
    assert [c.text for c in a] == [c.text for c in b]
    for c in a:
        assert re.fullmatch(r"(ab|cd|ef){2,6}", c.text)
        assert len(c.logprobs) == len(c.token_ids)
    stop = texts(llm, SamplingParams(temperature=1.0, max_tokens=60, stop=["cd"], n=10,
                                     structured_outputs=so))
    for c in stop:  # a stop string ends it early, as without a constraint
        assert "cd" not in c.text and re.fullmatch(r"(ab|ef)*", c.text)
    greedy = texts(llm, SamplingParams(temperature=0.0, max_tokens=20,
                                       structured_outputs=StructuredOutputsParams(
                                           choice=CHOICES)))
    assert greedy[0].text in CHOICES


def test_preemption_and_prefix_caching(tiny_llama):
    """A cache too small for the batch preempts (recompute) and reuses cached prefixes;
    every constrained output still conforms, and no block is left held."""
    llm = LLM(str(tiny_llama), device="cpu", block_size=4, num_kv_blocks=48, max_num_seqs=8)
    prompt = "the cat sat on the mat and the dog"
    outs = texts(llm, constrained(n=1, json=SCHEMA, disable_any_whitespace=True),
                 [prompt] * 12)
    assert llm.engine.scheduler.num_preemptions > 0
    for c in outs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.structured.by_seq  # constraints dropped with their requests


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=16, max_num_seqs=4),  # prompts prefilled in chunks
    dict(num_kv_blocks=40, swap_space=0.05, preemption_mode="swap", max_num_seqs=8),
])
def test_chunked_prefill_and_swap(tiny_llama, options):
    """Chunked prompts (a row samples only at its last chunk) and sequences swapped out and
    back keep their constraints."""
    options = dict(dict(num_kv_blocks=512), **options)
    llm = LLM(str(tiny_llama), device="cpu", block_size=4, **options)
    prompt = "the cat sat on the mat and the dog ran after the cat again"
    outs = texts(llm, constrained(json=SCHEMA, disable_any_whitespace=True), [prompt] * 8)
    for c in outs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    if "swap_space" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("kind, value, says", [
    ("regex", "([a-z]+", "structured_outputs.regex does not compile"),
    ("grammar", "start: foo\n", "structured_outputs.grammar does not compile"),
    ("json", {"type": "object", "properties": {"a": {"$ref": "#/nope"}}},
     "structured_outputs.json does not compile"),
    ("json", {"type": "string", "pattern": "(a|"}, "structured_outputs.json does not compile"),
    ("json", "{not json", "structured_outputs.json is invalid"),
    ("json", [1, 2], "structured_outputs.json is invalid"),
    ("choice", [], "structured_outputs.choice is invalid"),
    ("choice", ["a", 3], "structured_outputs.choice is invalid"),
    ("regex", "a" * 70_000, "at most 65536"),
    # keywords the grammar engine does not implement are refused, not silently dropped
    ("json", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     'Unimplemented keys: ["uniqueItems"]'),
    ("json", {"not": {"type": "string"}}, 'Unimplemented keys: ["not"]'),
    ("json", {"type": "string", "format": "no-such-format"}, "Unknown format"),
])
def test_bad_constraints_fail_before_queueing(llm, kind, value, says):
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    with pytest.raises(InvalidRequestError, match=re.escape(says)) as e:
        engine.add_request("the cat", constrained(**{kind: value}))
    assert e.value.param.startswith("structured_outputs")
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_free_blocks == free
    assert texts(llm, constrained(regex=REGEX))[0].finish_reason == "stop"  # still serving


def test_exactly_one_kind():
    with pytest.raises(InvalidRequestError, match="set exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="set exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="response_format.json_schema is invalid"):
        StructuredOutputsParams(json=3, param="response_format.json_schema")


@pytest.fixture(scope="module")
def default_grammars():
    """The grammar compiler on the default model's tokenizer (49,152 tokens): how hostile a
    regex is depends on the vocabulary its lexer walks."""
    from nanovllm.engine.tokenizer import load_tokenizer
    from nanovllm.model.loader.source import open_model

    tok = load_tokenizer(open_model(None))
    return Grammars(tok.backend.to_str(), 49152, set(tok.eos_token_ids))


def test_hostile_constraints_are_refused_within_limits(default_grammars):
    """Constraints that would explode the grammar engine (vLLM's CVE-2025-48942/48943 kind)
    are refused at compile time, within the limits, with an error that says so."""
    cases = [("regex", "(x{1000}){1000}", "exceeds what one request may cost"),
             ("json", {"type": "string", "pattern": "^(y{900}){900}$"},
              "exceeds what one request may cost")]
    deep = {"type": "object"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    cases.append(("json", deep, "recursion limit"))
    for kind, value, says in cases:
        with pytest.raises(InvalidRequestError, match=f"{kind} does not compile: .*{says}"):
            default_grammars.compile(StructuredOutputsParams(**{kind: value}))


def test_compiled_constraints_are_cached(llm):
    grammars = llm.engine.structured.grammars
    hits = grammars.hits
    texts(llm, constrained(n=3, regex=r"x{2,4}"))
    texts(llm, constrained(n=1, regex=r"x{2,4}"))
    assert grammars.hits >= hits + 3  # n copies and the second request: one compile


def test_constraint_waits_for_the_end_of_reasoning(tiny_llama):
    """With a reasoning parser, a row's mask is all-ones until `</think>` is accepted,
    unless its prompt closed the reasoning already (thinking turned off)."""
    from tokenizers import Tokenizer

    from nanovllm.core.sequence import Sequence

    tok = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    end = tok.token_to_id("<|im_end|>")  # stands for `</think>`: any single token works
    so = StructuredOutputs(Grammars(tok.to_str(), 512, {2}), reasoning_end=end)
    params = StructuredOutputsParams(choice=["red", "blue"])
    thinking = Sequence(0, [5, 6, 7], SamplingParams())
    closed = Sequence(1, [5, end, 9], SamplingParams())
    so.add(thinking, so.compile(params))
    so.add(closed, so.compile(params))
    mask = so.bitmask([thinking, closed])
    assert (mask[0] == -1).all() and not (mask[1] == -1).all()
    assert so.accept(thinking, 11) is None  # reasoning: unconstrained
    assert so.bitmask([thinking]) is None  # no row constrained now: no mask at all
    so.accept(thinking, end)
    assert not (so.bitmask([thinking])[0] == -1).all()
    assert so.bitmask([Sequence(2, [1], SamplingParams())]) is None


@pytest.mark.gpu
def test_gpu_with_cuda_graphs_and_overlap(tiny_llama):
    """On a GPU the mask meets CUDA graphs (decode logits from a replayed graph), overlap
    (the bitmask waits on the step before) and the one-pass sampler."""
    llm = LLM(str(tiny_llama), device="cuda", max_num_seqs=64, num_kv_blocks=1024,
              block_size=16)
    assert llm.engine.config.cuda_graphs and llm.engine.overlap
    outs = texts(llm, constrained(n=64, json=SCHEMA, disable_any_whitespace=True), ["a"])
    for c in outs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    mixed = [SamplingParams(temperature=1.0, max_tokens=30)] * 8 + [
        constrained(regex=REGEX)] * 8  # constrained and free rows in one batch
    got = llm.generate(["the cat"] * 16, mixed, use_tqdm=False)
    assert all(re.fullmatch(REGEX, o.outputs[0].text) for o in got[8:])
    assert any(not re.fullmatch(REGEX, o.outputs[0].text) for o in got[:8])


def test_an_eos_id_past_the_tokenizer_is_not_fatal(tiny_llama):
    """A model config may name an EOS id its tokenizer does not have (the logits are wider
    than the vocabulary): the grammar engine still loads, and constraints still end."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    grammars = Grammars(tok.to_str(), 512, {2, 500})  # 500: past the 400-token vocabulary
    matcher = grammars.compile(StructuredOutputsParams(choice=["a"]))
    assert not matcher.is_error()


def test_a_grammar_engine_failure_fails_the_request_only(llm, monkeypatch, caplog):
    """Should llguidance's binding raise something it does not document, the request gets
    an error naming its field, the log gets the details, and the engine serves on."""
    from nanovllm.engine import structured_output

    def broken(*args, **kwargs):
        raise RuntimeError("internal detail that must not reach a client")

    monkeypatch.setattr(structured_output, "_probe", broken)  # runs inside the binding call
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request("x", constrained(regex="never-compiled-before"))
    assert e.value.param == "structured_outputs.regex"
    assert "internal detail" not in str(e.value) and "could not be compiled" in str(e.value)
    assert "internal detail" in caplog.text
    monkeypatch.undo()
    assert texts(llm, constrained(regex=REGEX))[0].finish_reason == "stop"
