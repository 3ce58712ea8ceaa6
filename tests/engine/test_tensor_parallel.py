"""Tensor parallelism on the CPU: the ranks are real processes joined by torch.distributed's
gloo backend, as on CI's two cores. Greedy outputs at tensor_parallel_size=2 equal
transformers' and one device's (split and replicated KV heads, tied embeddings, a vocabulary
that does not split evenly, chunked prefill, preemption by recompute and by swap); sampling
with top-k/p, penalties and logprobs equals one device's; the env:// rendezvous joins ranks
started apart, as on two hosts; a rank that dies ends the engine with an error that names
it, never a hang."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from nanovllm import LLM, ConfigError, SamplingParams
from nanovllm.worker.tensor_parallel import RankFailedError
from tests.support import build_tiny_model, greedy, hf_greedy, load_hf_model, make_prompts

MAX_TOKENS = 10
MODELS = {
    # 4 query heads and 2 KV heads: one KV head per rank
    "qwen3": ("qwen3", {}),
    # one KV head for 2 ranks: replicated; tied embeddings; 511 rows: the last rank pads one
    "llama_kv1": ("llama", dict(num_key_value_heads=1)),
    "qwen2_odd_vocab": ("qwen2", dict(vocab_size=511)),
}
SETTINGS = {
    "chunked": dict(max_num_batched_tokens=8, max_num_seqs=4, block_size=4, num_kv_blocks=256),
    "preempt": dict(num_kv_blocks=24, block_size=4, max_model_len=96, max_num_seqs=8,
                    admission_headroom=0),
    "swap": dict(num_kv_blocks=24, block_size=4, max_model_len=96, max_num_seqs=8,
                 admission_headroom=0, swap_space=0.01, preemption_mode="swap"),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    arch, shape = MODELS[request.param]
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), arch, **shape)
    return path, load_hf_model(path)


def run(path, prompts, params, device="cpu", **options):
    llm = LLM(path and str(path), device=device, **options)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        sched = llm.engine.scheduler
        return outs, sched.num_preemptions, llm.engine.block_manager.num_free_blocks
    finally:
        llm.shutdown()


# each model once and each setting once: every model holds one KV head a rank, so a
# setting's steps and copies (rank 0 schedules, every rank runs them) meet the same shards
PAIRS = [("llama_kv1", "swap"), ("qwen2_odd_vocab", "chunked"), ("qwen3", "preempt")]


@pytest.mark.parametrize("model, setting", PAIRS, indirect=["model"])
def test_tp2_greedy_equals_transformers_and_one_device(model, setting):
    path, hf = model
    prompts = make_prompts(seed=3, count=8, shared_prefix=12)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    one, _, _ = run(path, prompts, params, **SETTINGS[setting])
    two, preemptions, free = run(path, prompts, params, tensor_parallel_size=2,
                                 **SETTINGS[setting])
    for prompt, a, b in zip(prompts, one, two):
        assert b.token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
        assert b.token_ids == a.token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[k] - lb[k]) < 1e-4 for k in la)
    if setting != "chunked":
        assert preemptions > 0, "the setting was meant to preempt"
    assert free == SETTINGS[setting]["num_kv_blocks"], "a KV block leaked"


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_tp2_on_two_gpus_equals_transformers_and_one_gpu(model, graphs):
    """NCCL: the step's inputs broadcast from rank 0's buffers, CUDA graphs captured on both
    ranks with their all-reduces inside, overlap on (the GPU default)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    path, hf = model
    prompts = make_prompts(seed=3, count=8, shared_prefix=12)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    options = dict(device="cuda", dtype="float32", num_kv_blocks=256, block_size=16,
                   enforce_eager=not graphs)
    one, _, _ = run(path, prompts, params, **options)
    two, _, free = run(path, prompts, params, tensor_parallel_size=2, **options)
    for prompt, a, b in zip(prompts, one, two):
        assert b.token_ids == hf_greedy(hf, prompt, MAX_TOKENS) == a.token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert all(abs(la[k] - lb[k]) < 1e-3 for k in la)
    assert free == 256


def test_tp2_sampling_equals_one_device(tmp_path):
    """Seeded sampling with top-k, top-p, min-p, penalties and logprobs sees the whole
    vocabulary on rank 0 (the LM head's slices are gathered), so it draws what one device
    draws."""
    path = build_tiny_model(tmp_path / "m", "qwen3", vocab_size=511)
    prompts = make_prompts(seed=5, count=6)
    params = [
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=11, max_tokens=12, logprobs=5),
        SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.4, seed=12, max_tokens=12,
                       logprobs=2, n=2),
        SamplingParams(temperature=0.7, seed=13, max_tokens=12),
    ] * 2
    one, _, _ = run(path, prompts, params, num_kv_blocks=256)
    two, _, _ = run(path, prompts, params, num_kv_blocks=256, tensor_parallel_size=2)
    for a, b in zip(one, two):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.token_ids == cb.token_ids
            for la, lb in zip(ca.logprobs or [], cb.logprobs or [], strict=True):
                assert la.keys() == lb.keys() and all(abs(la[k] - lb[k]) < 1e-4 for k in la)


def test_tp2_with_an_fp8_cache_equals_one_device(tiny_llama):
    """Each rank quantizes its own KV heads; the scales are per token and head, so the
    shards hold exactly the bytes one device holds."""
    prompts = make_prompts(seed=6, count=6, shared_prefix=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    opts = dict(kv_cache_dtype="fp8", num_kv_blocks=128)
    one, _, _ = run(tiny_llama, prompts, params, **opts)
    two, _, _ = run(tiny_llama, prompts, params, tensor_parallel_size=2, **opts)
    for a, b in zip(one, two):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert all(abs(la[k] - lb[k]) < 1e-4 for k in la)


def test_default_model_over_three_ranks_equals_one():
    """The real default model, its GGUF 4-bit weights sharded and kept packed (int4) on each
    rank: 9 query heads and 3 KV heads split over 3 ranks give the text one process gives,
    up to a near-tie. The int4 kernel rounds its activations to bfloat16, so the ranks'
    partial sums move a logprob by up to ~0.1 nats: "def fibonacci(n):"'s 14th token is a
    near-tie (0.02-0.05 nats between two tokens), which went either way with either
    kernels."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
    one, _, _ = run(None, prompts, params, kv_cache_gib=0.05)
    three, _, _ = run(None, prompts, params, kv_cache_gib=0.05, tensor_parallel_size=3)
    for a, b in zip(one, three, strict=True):
        steps = zip(a.token_ids, b.token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs)
        for i, (ta, tb, la, lb) in enumerate(steps):
            if ta != tb:  # a near-tie: the text may part there, nowhere earlier
                assert tb in la and la[ta] - la[tb] < 0.1, (i, la, lb)
                break
            assert abs(la[ta] - lb[tb]) < 0.15, (i, la, lb)
    assert three[0].token_ids == one[0].token_ids


def test_bad_tensor_parallel_settings_say_what_to_change(tiny_llama, monkeypatch):
    with pytest.raises(ConfigError, match="4 attention heads .* tensor_parallel_size=3"):
        LLM(str(tiny_llama), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="tensor_parallel_size=0"):
        LLM(str(tiny_llama), device="cpu", tensor_parallel_size=0)
    for name, value in dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="rank 1 of WORLD_SIZE=2.*nanovllm worker"):
        LLM(str(tiny_llama), device="cpu", tensor_parallel_size=2)
    monkeypatch.delenv("RANK")
    with pytest.raises(ConfigError, match="set RANK"):
        LLM(str(tiny_llama), device="cpu", tensor_parallel_size=2)


def test_one_tensor_parallel_engine_per_process(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
    try:
        with pytest.raises(ConfigError, match="shut that engine down first"):
            LLM(str(tiny_llama), device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
    finally:
        llm.shutdown()
    pid = llm.engine.runner.peers
    assert pid.procs == [], "shutdown left a rank running"
    again = LLM(str(tiny_llama), device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
    assert again.generate([[5, 6, 7]], greedy(3), use_tqdm=False)[0].token_ids
    again.shutdown()


def test_a_failed_start_up_leaves_no_rank_and_no_group(tiny_llama):
    """The KV cache is sized after every rank has started: a size that cannot hold one
    sequence is a ConfigError, the other rank goes, and the next engine starts at once."""
    with pytest.raises(ConfigError, match="max_model_len=256 needs at least"):
        LLM(str(tiny_llama), device="cpu", num_kv_blocks=2, max_model_len=256,
            tensor_parallel_size=2)
    llm = LLM(str(tiny_llama), device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
    assert llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)[0].token_ids
    llm.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nanovllm", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


GENERATE = ["generate", "--raw", "--temperature", "0", "--max-tokens", "12", "--ignore-eos",
            "--num-kv-blocks", "64", "The quick brown fox"]


@pytest.fixture(scope="module")
def one_process_text(tiny_llama) -> tuple[list[str], str]:
    """GENERATE on the tiny Llama, and what one process prints for it."""
    command = GENERATE[:1] + ["--model", str(tiny_llama)] + GENERATE[1:]
    alone = _cli(*command)
    expected, err = alone.communicate(timeout=120)
    assert alone.returncode == 0, err
    return command, expected


@pytest.mark.parametrize("rank1", ["worker", "same command"])
def test_env_rendezvous_joins_ranks_started_apart(one_process_text, rank1):
    """Two "hosts": each rank is started on its own with the launcher's variables (as
    torchrun or Slurm would, LOCAL_RANK 0 on both); rank 0 runs `nanovllm generate`, rank 1
    `nanovllm worker` or the same command (as torchrun starts it on every rank), which
    serves as a worker. The text equals one device's; rank 1 leaves when rank 0 ends."""
    command, expected = one_process_text
    port = _free_port()
    base = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                LOCAL_RANK="0")
    tp = ["--tensor-parallel-size", "2"]
    worker = _cli(*(["worker"] if rank1 == "worker" else command + tp), env=dict(base, RANK="1"))
    leader = _cli(*command, *tp, env=dict(base, RANK="0"))
    try:
        out, err = leader.communicate(timeout=120)
        assert leader.returncode == 0, err
        assert out == expected
        assert worker.wait(timeout=30) == 0, worker.stderr.read()
        assert worker.stdout.read() == ""  # the worker printed no text of its own
    finally:
        for proc in (worker, leader):
            if proc.poll() is None:
                proc.kill()


def test_torchrun_starts_every_rank_with_the_same_command(one_process_text):
    command, expected = one_process_text
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), "-m", "nanovllm", *command,
         "--tensor-parallel-size", "2"],
        capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected  # rank 0's text; rank 1 printed nothing


DEATH = textwrap.dedent("""
    import os, signal, sys, time
    from nanovllm import LLM, SamplingParams
    from nanovllm.worker.tensor_parallel import RankFailedError

    llm = LLM(sys.argv[1], device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
    params = SamplingParams(temperature=0, max_tokens=4)
    assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
    worker = llm.engine.runner.peers.procs[0]
    if sys.argv[2] == "worker":
        os.kill(worker.pid, signal.SIGKILL)
        for attempt in range(2):  # the step that meets the death, and the one after
            try:
                llm.generate([[8, 9, 10]], params, use_tqdm=False)
            except RankFailedError as e:
                print("error:", e, flush=True)
        llm.shutdown()
        print("ended", flush=True)
    else:
        print("worker", worker.pid, flush=True)
        time.sleep(600)
""")


def test_a_dead_rank_ends_the_engine_with_a_clear_error(tiny_llama, tmp_path):
    script = tmp_path / "death.py"
    script.write_text(DEATH)
    proc = subprocess.run([sys.executable, str(script), str(tiny_llama), "worker"],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    assert len([x for x in lines if x.startswith("error:")]) == 2, proc.stdout + proc.stderr
    assert "tensor-parallel rank 1" in lines[0] and "exited with code -9" in lines[0]
    assert "cannot continue" in lines[0] and lines[-1] == "ended"


def test_rank_0_failing_mid_step_ends_the_engine_not_in_a_hang(tiny_llama, monkeypatch):
    """Rank 0 fails after the other rank started the step (here: its forward pass raises, as
    an out-of-memory error would): the error reaches the caller as it is, the next call says
    the ranks are out of step instead of waiting in a collective, and shutdown still ends
    the other rank."""
    llm = LLM(str(tiny_llama), device="cpu", num_kv_blocks=64, tensor_parallel_size=2)
    runner = llm.engine.runner
    proc = runner.peers.procs[0]
    try:
        def out_of_memory(inputs):
            raise MemoryError("no room for the step")

        monkeypatch.setattr(runner, "logits", out_of_memory)
        with pytest.raises(MemoryError, match="no room"):
            llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)
        monkeypatch.undo()
        with pytest.raises(RankFailedError, match="rank 0 stopped in the middle of a step"):
            llm.generate([[8, 9]], greedy(3), use_tqdm=False)
    finally:
        llm.shutdown()
    assert proc.wait(timeout=20) is not None


def test_a_rank_leaves_when_rank_0_dies(tiny_llama, tmp_path):
    script = tmp_path / "death.py"
    script.write_text(DEATH)
    leader = subprocess.Popen([sys.executable, str(script), str(tiny_llama), "leader"],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = leader.stdout.readline()
        assert line.startswith("worker "), line
        pid = int(line.split()[1])
        leader.send_signal(signal.SIGKILL)
        leader.wait(timeout=10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            if _zombie(pid):
                return
            time.sleep(0.1)
        pytest.fail(f"rank 1 (pid {pid}) outlived rank 0 by 20 s")
    finally:
        if leader.poll() is None:
            leader.kill()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
