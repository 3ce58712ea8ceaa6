"""Fixtures of the model tests."""

import pytest
import torch


@pytest.fixture(scope="session")
def wide_llama() -> tuple[dict, dict]:
    """(config, state dict) of a random 2-layer Llama with rows 256 or 512 wide: K-quants pack
    256 weights a block."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn_like(p)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return config.to_dict(), model.state_dict()
