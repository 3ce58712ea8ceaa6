"""What crosses the boundary between the server's front end and its engine process."""

from dataclasses import dataclass, field

from nanovllm.core.config import EngineConfig


@dataclass(frozen=True)
class EngineProcessConfig:
    """Everything the engine process is started with."""

    model: str | None  # a model directory or .gguf file; None: the default model
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_num_waiting: int | None = 256  # requests allowed to wait; more are rejected (429)
    log_interval: float = 10.0  # seconds between engine status lines
