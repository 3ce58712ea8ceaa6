"""Test harness shared by every test package: tiny random models in Hugging Face layout,
transformers' reference model and decoding, prompt generators, greedy parameters, the
chi-square check of sampled tokens, and the Triton availability rule."""

import importlib
import importlib.util
import json
import math
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from nanovllm.core.sampling_params import SamplingParams

# pyproject.toml's test extra declares triton on Linux only: there a missing triton fails
# the run (conftest.py); elsewhere the Triton tests skip
TRITON_DECLARED = sys.platform == "linux"

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "A scheduler decides which tokens run in each step of the engine loop.",
    "Prefix caching lets requests that share a system prompt reuse blocks.",
    "1234567890 + - * / = ( ) [ ] { } < > ! ? , . ; :",
    "héllo wörld, naïve café, 東京, 😀 emoji",
] * 20

TINY_ARCHS = {
    "llama": dict(architecture="LlamaForCausalLM", model_type="llama", tie_word_embeddings=False),
    "qwen2": dict(architecture="Qwen2ForCausalLM", model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(
        architecture="Qwen3ForCausalLM", model_type="qwen3", tie_word_embeddings=False, head_dim=32
    ),
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# A Qwen3-style template written for the tests: tools in a system turn, calls as hermes
# <tool_call> blocks, tool results as <tool_response> user turns, and thinking turned off by
# an empty <think></think> in the prompt (enable_thinking=False)
AGENT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools; write each call as "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% if m.content %}{{ m.content }}{% endif %}{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
AGENT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def build_tokenizer_files(path: Path, vocab_size: int = 400, agent: bool = False) -> None:
    """A byte-level BPE trained on a tiny corpus, saved as tokenizer.json + config; `agent`:
    with AGENT_TEMPLATE and its tags as added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    if agent:
        tok.add_tokens(AGENT_TOKENS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": AGENT_TEMPLATE if agent else CHAT_TEMPLATE,
                "add_bos_token": False,
            }
        )
    )


def build_tiny_model(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """A 2-layer randomly initialized model of the given family, saved in HF layout."""
    import transformers

    agent = overrides.pop("agent", False)
    spec = dict(TINY_ARCHS[arch], **overrides)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer_files(path, agent=agent)
    config_cls = transformers.AutoConfig.for_model(spec.pop("model_type")).__class__
    architecture = spec.pop("architecture")
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config = config_cls(
        rms_norm_eps=1e-6,
        eos_token_id=2,
        bos_token_id=None,
        pad_token_id=0,
        architectures=[architecture],
        **dict(shape, **spec),
    )
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).float()
    with torch.no_grad():  # larger, non-trivial weights so greedy choices are well separated
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return path


def load_hf_model(path: Path, dtype: torch.dtype = torch.float32, **options):
    """transformers' own model of a Hugging Face directory (or of `gguf_file=` in it), in
    eval mode: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **options).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference greedy decoding: a full forward pass per token, no cache, no shortcuts."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :]


def make_prompts(seed: int, count: int, shared_prefix: int = 0) -> list[list[int]]:
    """Random token-id prompts of 1-40 tokens (ids 3-399), optionally behind a shared prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 400) for _ in range(shared_prefix)]
    return [
        prefix + [rng.randrange(3, 400) for _ in range(rng.randint(1, 40))] for _ in range(count)
    ]


def greedy(max_tokens: int, **overrides) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens (EOS ignored), as references compare."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **overrides)


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_module(name: str) -> ModuleType:
    """Import a Triton kernel module for a test module; where triton is not a declared
    test dependency and is missing, skip the whole test module, saying why."""
    if not has_triton():
        pytest.skip("triton is not installed (the test extra declares it on Linux only)",
                    allow_module_level=True)
    return importlib.import_module(name)


# well-separated probabilities (no ties, no filter boundary close to a cumulative sum)
SMALL_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.3, 0.0, -0.5, -1.0])


def assert_matches(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Sampled `tokens` follow `probs`: excluded tokens never appear; the rest pass a
    chi-square test at alpha = 1e-4."""
    counts = torch.bincount(tokens.cpu(), minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0, f"excluded tokens sampled: {counts.tolist()}"
    kept = probs > 0
    expected = probs[kept] * len(tokens)
    stat = ((counts[kept] - expected) ** 2 / expected).sum().item()
    df = int(kept.sum()) - 1
    if df == 0:
        return
    # Wilson-Hilferty approximation of the chi-square quantile, z = 3.719 for 1e-4
    a = 2 / (9 * df)
    critical = df * (1 - a + 3.719 * math.sqrt(a)) ** 3
    assert stat < critical, f"chi2={stat:.1f} >= {critical:.1f}; counts={counts.tolist()}"


@torch.inference_mode()
def engine_logprobs(llm, ids: list[int], prefill: int | None = None) -> torch.Tensor:
    """The engine model's log next-token distributions after each prefix of `ids` ([len(ids),
    vocab], float64), teacher-forced through its own layers and KV cache (blocks 0.., so the
    prefix cache is reset; no request may be running): one prefill of the whole sequence, or
    with `prefill` as generation meets them, the first `prefill` ids in one step and each
    later one in a decode step of its own."""
    from nanovllm.kernels.attention_metadata import AttentionMetadata

    runner = llm.engine.runner
    bs = runner.config.block_size
    assert llm.engine.scheduler.block_manager.reset_prefix_cache(), "requests are running"
    table = torch.arange(-(-len(ids) // bs), dtype=torch.int32)[None]

    def step(start: int, stop: int) -> torch.Tensor:
        n = stop - start
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, stop, dtype=torch.int64),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            context_lens=torch.tensor([stop], dtype=torch.int32), block_tables=table,
            max_query_len=n, max_context_len=stop, query_lens_host=[n],
            context_lens_host=[stop])
        hidden = runner.model(torch.tensor(ids[start:stop]), torch.arange(start, stop), meta)
        return torch.log_softmax(runner.model.compute_logits(hidden).double(), -1)

    first = len(ids) if prefill is None else prefill
    return torch.cat([step(0, first)] + [step(i, i + 1) for i in range(first, len(ids))])
