import collections
import ctypes
import functools
import sys
from collections.abc import Iterable

import torch
from torch import nn

from nanovllm.core.errors import ModelLoadError
from nanovllm.model.layers.quantized import QuantizedWeight, read_part


def load_weights(
    model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
    weight_format: str = "dense",
) -> dict[str, int]:
    """Copy checkpoint tensors (Hugging Face names) into the model's parameters.

    A tensor may be lazy (ModelSource.tensors): each layer's `weight_loader` reads the slice
    its rank holds under tensor parallelism, so no rank reads the whole model.

    q/k/v and gate/up are stored apart in checkpoints and merged here. Quantized tensors
    (from GGUF files) stay quantized where the layer has a packed form and `weight_format`
    is "int4" or "int4-bf16" (see EngineConfig), else they are dequantized. Returns how many
    weights took each form.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    packed = getattr(model, "packed_modules", {})
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for name, tensor in tensors:
        if "rotary_emb" in name or (tied and name == "lm_head.weight"):
            continue
        shard = None
        for part, (merged, shard_name) in packed.items():
            if f".{part}." in name:
                name, shard = name.replace(f".{part}.", f".{merged}."), shard_name
                break
        param = params.get(name)
        if param is None:
            continue  # tensors the model does not use
        module = modules[name.rsplit(".", 1)[0]]
        loader = getattr(module, "weight_loader", None)
        if loader is None:  # replicated (norms): read whole
            tensor = read_part(tensor)
            if isinstance(tensor, QuantizedWeight):
                tensor = tensor.dequantize()
        try:
            if loader is not None:
                loader(param, tensor, shard)
            else:
                param.data.copy_(
                    tensor.view(param.shape) if tensor.numel() == param.numel() else tensor
                )
        except (RuntimeError, ValueError) as e:
            raise ModelLoadError(f"checkpoint tensor {name!r} does not fit the model: {e}") from e
        loaded.add(name if shard is None else f"{name}:{shard}")
    expected = set()
    for name in params:
        module = modules[name.rsplit(".", 1)[0]]
        shards = getattr(module, "offsets", None)
        if shards:
            expected.update(f"{name}:{s}" for s in shards)
        else:
            expected.add(name)
    if tied:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(
            f"the checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}"
        )
    forms: collections.Counter[str] = collections.Counter()
    for module in model.modules():
        finish = getattr(module, "finish_loading", None)
        if finish is not None:
            forms[finish(weight_format)] += 1
            if weight_format != "dense":
                _return_freed_memory()
    return dict(forms)


def _return_freed_memory() -> None:
    """Packing a weight frees float32 temporaries of several MB; glibc keeps such freed heap
    pages resident (its mmap threshold rises after the first large free), so a load could end
    600 MB larger one run than the next. Hand them back to the OS after each layer."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl): nothing kept back to return
        return None
