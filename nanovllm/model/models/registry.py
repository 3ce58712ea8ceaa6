from torch import nn

from nanovllm.kernels import Kernels
from nanovllm.model.config import ModelConfig
from nanovllm.model.models.llama import LlamaForCausalLM
from nanovllm.model.parallel import SINGLE, TensorParallel

# Qwen2 and Qwen3 are the Llama decoder with config flags (qkv bias, q/k norm).
MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def build_model(
    cfg: ModelConfig, max_position: int, kernels: Kernels, tp: TensorParallel = SINGLE
) -> nn.Module:
    """The model of `cfg`'s architecture, its layers running `kernels`; under tensor
    parallelism (`tp`) this rank's shard of it."""
    return MODELS[cfg.architecture](cfg, max_position, kernels, tp)
