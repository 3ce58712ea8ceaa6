import json
from collections.abc import Iterator
from pathlib import Path

from safetensors import safe_open

from nanovllm.core.errors import ModelLoadError


def read_hf_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"{path} has no config.json; pass a Hugging Face model directory or a .gguf file"
        )
    cfg = json.loads(config_file.read_text())
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen = json.loads(gen_file.read_text())
        if gen.get("eos_token_id") is not None:
            eos = cfg.get("eos_token_id")
            ids = set([eos] if isinstance(eos, int) else eos or [])
            g = gen["eos_token_id"]
            ids |= set([g] if isinstance(g, int) else g)
            cfg["eos_token_id"] = sorted(ids)
    return cfg


class SafetensorsWeight:
    """One tensor of an open safetensors file, read when a layer asks for it, and only the
    slice it asks for (safetensors reads a slice without the rest)."""

    def __init__(self, file, name: str) -> None:
        self.file, self.name = file, name
        self.shape = tuple(file.get_slice(name).get_shape())

    def read(self, dim: int | None = None, start: int = 0, length: int | None = None):
        if dim is None:
            return self.file.get_tensor(self.name)
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self.file.get_slice(self.name)[index]


def safetensors_weights(path: Path) -> Iterator[tuple[str, SafetensorsWeight]]:
    """Every tensor of the directory's *.safetensors files, as SafetensorsWeight; a file
    stays open while its tensors are handed out."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} holds no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, SafetensorsWeight(f, name)
