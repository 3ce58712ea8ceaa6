"""EngineConfig refuses every value the engine cannot run with, naming the option and the
range to use, and accepts each boundary; ResolvedConfig summarizes itself in one line."""

import dataclasses

import pytest

from nanovllm.core.config import EngineConfig, ResolvedConfig
from nanovllm.core.errors import ConfigError

# option -> (the largest or smallest value refused, the nearest one accepted)
BOUNDARIES = {
    "max_num_seqs": (0, 1),
    "admission_max_delay": (-1, 0),
    "num_kv_blocks": (0, 1),
    "kv_cache_gib": (0.0, 0.001),
    "gpu_memory_utilization": (0.0, 1.0),
    "max_model_len": (0, 1),
}


@pytest.mark.parametrize("name", sorted(BOUNDARIES))
def test_each_boundary(name):
    refused, accepted = BOUNDARIES[name]
    extra = {"max_num_batched_tokens": 1} if name == "max_num_seqs" else {}
    assert getattr(EngineConfig(**{name: accepted}, **extra), name) == accepted
    with pytest.raises(ConfigError, match=f"{name}=") as e:
        EngineConfig(**{name: refused})
    assert "invalid" in str(e.value)


@pytest.mark.parametrize("kwargs, name", [
    (dict(gpu_memory_utilization=1.01), "gpu_memory_utilization"),
    (dict(block_size=0), "block_size"),
    (dict(block_size=12), "block_size"),
    (dict(scheduling_policy="lifo"), "scheduling_policy"),
    (dict(dtype="int8"), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(attention_backend="flash"), "attention_backend"),
    (dict(max_num_seqs=8, max_num_batched_tokens=7), "max_num_batched_tokens"),
    (dict(admission_batch=0), "admission_batch"),
    (dict(max_num_seqs=4, max_num_batched_tokens=64, admission_batch=5), "admission_batch"),
])
def test_bad_values_name_the_option(kwargs, name):
    with pytest.raises(ConfigError, match=f"{name}="):
        EngineConfig(**kwargs)


def test_boundaries_that_are_accepted():
    EngineConfig(max_num_seqs=8, max_num_batched_tokens=8)
    EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, admission_batch=4)
    EngineConfig(admission_batch=1)
    for size in (1, 2, 16, 256):
        assert EngineConfig(block_size=size).block_size == size
    for policy in ("fair", "prefill_first"):
        EngineConfig(scheduling_policy=policy)
    for dtype in ("auto", "float32", "bfloat16", "float16"):
        EngineConfig(dtype=dtype)
    for backend in ("auto", "triton", "torch"):
        EngineConfig(attention_backend=backend)


def test_from_options_names_unknown_options():
    assert EngineConfig.from_options(max_num_seqs=3).max_num_seqs == 3
    with pytest.raises(ConfigError, match=r"unknown engine option\(s\) \['max_seqs'\]"):
        EngineConfig.from_options(max_seqs=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().max_num_seqs = 2  # type: ignore[misc]


def test_resolved_summary_and_capacity():
    cfg = ResolvedConfig(
        asked=EngineConfig(), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=64, block_size=16, num_kv_blocks=10, admission_batch=1,
        cuda_graphs=False, overlap=True, kernels="torch", attention_backend="torch",
        num_threads=None,
    )
    assert cfg.kv_cache_tokens == 160
    assert cfg.seed == 0 and cfg.scheduling_policy == "fair"  # read through from `asked`
    assert dataclasses.replace(cfg, num_kv_blocks=None).kv_cache_tokens == 0
    flipped = dataclasses.replace(cfg, cuda_graphs=True, overlap=False,
                                  asked=EngineConfig(enable_prefix_caching=False)).summary()
    assert "cuda_graphs=on overlap=off" in flipped and "prefix_caching=off" in flipped
    line = cfg.summary()
    assert "\n" not in line
    for part in ("device=cpu", "dtype=float32", "max_model_len=128", "max_num_seqs=4",
                 "max_num_batched_tokens=64", "kv_cache=10x16", "prefix_caching=on",
                 "policy=fair", "admission_batch=1", "cuda_graphs=off", "overlap=on",
                 "kernels=torch", "attention=torch"):
        assert part in line, (part, line)


# the whole message: it names the value and says what to use instead
MESSAGES = [
    (dict(scheduling_policy="lifo"),
     "scheduling_policy='lifo' is invalid: choose one of fair, prefill_first"),
    (dict(max_num_seqs=0), "max_num_seqs=0 is invalid: use an integer >= 1"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0 is invalid: use an integer >= 1"),
    (dict(max_num_seqs=4, max_num_batched_tokens=64, admission_batch=5),
     "admission_batch=5 is invalid: use an integer in [1, max_num_seqs=4]"),
    (dict(admission_max_delay=-1),
     "admission_max_delay=-1 is invalid: use a number of steps >= 0"),
    (dict(max_num_seqs=8, max_num_batched_tokens=7),
     "max_num_batched_tokens=7 is invalid: it must be >= max_num_seqs=8 so every running "
     "sequence can decode each step"),
    (dict(block_size=12), "block_size=12 is invalid: use a power of two such as 16"),
    (dict(num_kv_blocks=0), "num_kv_blocks=0 is invalid: use a positive integer, or leave it "
     "unset to size it from memory"),
    (dict(kv_cache_gib=-1.0), "kv_cache_gib=-1.0 is invalid: use a positive size in GiB"),
    (dict(gpu_memory_utilization=1.5),
     "gpu_memory_utilization=1.5 is invalid: use a fraction in (0, 1]"),
    (dict(dtype="fp8"),
     "dtype='fp8' is invalid: choose one of auto, float32, bfloat16, float16"),
    (dict(device="tpu"), "device='tpu' is invalid: choose one of auto, cpu, cuda"),
    (dict(attention_backend="flash"),
     "attention_backend='flash' is invalid: choose one of auto, triton, native, torch"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype='int8' is invalid: choose one of auto, fp8"),
    (dict(max_model_len=0), "max_model_len=0 is invalid: use an integer >= 1"),
]


@pytest.mark.parametrize("kwargs, message", MESSAGES, ids=[m[1].split("=")[0] for m in MESSAGES])
def test_messages_in_full(kwargs, message):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kwargs)
    assert str(e.value) == message


def test_every_device_name_is_accepted():
    for device in ("auto", "cpu", "cuda"):  # a config only: nothing is allocated
        assert EngineConfig(device=device).device == device


def test_step_limits_fit_the_device(monkeypatch):
    """max_num_seqs / max_num_batched_tokens: given values stand; the others are the device's
    (64 / 2,048 on a CPU; 512 / 16,384 on a GPU of 40 GiB or more, 256 / 8,192 below), never
    contradicting a given one; after sizing, an automatic max_num_seqs is at most the KV
    cache's blocks."""
    import torch

    from nanovllm.engine import resolve

    cpu = EngineConfig()
    assert resolve._step_limits(cpu, cuda=False) == (64, 2048)

    class Props:
        total_memory = 141 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    assert resolve._step_limits(cpu, cuda=True) == (512, 16384)
    assert resolve._step_limits(EngineConfig(max_num_seqs=1024), cuda=True) == (1024, 16384)
    assert resolve._step_limits(EngineConfig(max_num_seqs=40000), cuda=True) == (40000, 40000)
    assert resolve._step_limits(EngineConfig(max_num_batched_tokens=300), cuda=True) == (300, 300)
    Props.total_memory = 24 * 2**30
    assert resolve._step_limits(cpu, cuda=True) == (256, 8192)
    resolved = ResolvedConfig(
        asked=cpu, device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=512,
        max_num_batched_tokens=16384, block_size=16, admission_batch=16, cuda_graphs=True,
        overlap=True, kernels="triton", attention_backend="triton", num_threads=None,
    )
    small = resolve.fit_kv_cache(resolved, num_blocks=10)
    assert (small.max_num_seqs, small.admission_batch) == (10, 10)
    assert resolve.fit_kv_cache(resolved, num_blocks=4000).max_num_seqs == 512
    kept = resolve.fit_kv_cache(dataclasses.replace(
        resolved, asked=EngineConfig(max_num_seqs=512)), num_blocks=10)
    assert kept.max_num_seqs == 512  # asked for: kept


def test_block_size_fits_the_cache_format(caplog):
    """block_size: a given one stands; else 16, but 128 for an fp8 cache the Triton kernels
    read (their fp8 tiles stay within one block, so 16-token blocks are 16-token tiles); a
    smaller one given for such a cache stands, with a warning that says what it costs."""
    from nanovllm.engine import resolve

    def size(cuda=True, attention="triton", **kwargs):
        return resolve._block_size(EngineConfig(**kwargs), attention, cuda)

    assert size() == size(kv_cache_dtype="auto") == resolve.BLOCK_SIZE == 16
    assert size(kv_cache_dtype="fp8") == resolve.FP8_BLOCK_SIZE == 128
    assert size(kv_cache_dtype="fp8", cuda=False, attention="torch") == 16
    assert size(kv_cache_dtype="fp8", attention="torch") == 16
    assert size(block_size=256) == 256
    assert not caplog.records
    assert size(kv_cache_dtype="fp8", block_size=16) == 16
    assert "block_size=16 with the fp8 KV cache" in caplog.text and "128" in caplog.text
