"""Split-K projections (kernels/triton/linear.py) and the residual-add RMSNorm that sums their
partial products (triton.ops.add_rms_norm), against a plain matmul then the torch norm
(kernels/torch_ops.py); and an engine running them, against transformers.

Small shapes run in Triton's CPU interpreter in fp32 and fp16 (its bf16 dot is wrong on a
CPU), and, marked gpu, compiled; the gpu tests repeat the check at Qwen3-0.6B's and 8B's
shapes in bf16.
"""

import pytest
import torch
import torch.nn.functional as F

from nanovllm import LLM
from nanovllm.core.config import EngineConfig
from nanovllm.engine.resolve import resolve_config
from nanovllm.kernels import select_kernels
from nanovllm.kernels import torch_ops as ref
from nanovllm.model.config import ModelConfig
from tests.support import greedy, hf_greedy, make_prompts, triton_module

linear = triton_module("nanovllm.kernels.triton.linear")
fused = triton_module("nanovllm.kernels.triton.ops")
# fp32: summation order only; half dtypes: the partials are summed in fp32 and rounded once,
# as cuBLAS rounds its fp32 accumulator, so a rounding or two of the dtype
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def randn(*shape, device, dtype, seed, scale=1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)


def check(rows: int, k: int, n: int, dtype, device) -> int:
    """split_k_linear then add_rms_norm against F.linear then torch's add_rms_norm; returns
    the number of partials."""
    x = randn(rows, k, device=device, dtype=dtype, seed=1)
    w = randn(n, k, device=device, dtype=dtype, seed=2, scale=k ** -0.5)
    residual = randn(rows, n, device=device, dtype=dtype, seed=3)
    norm_w = (1 + 0.1 * randn(n, device=device, dtype=torch.float32, seed=4)).to(dtype)
    expected_out, expected_res = ref.add_rms_norm(F.linear(x, w), residual.clone(), norm_w, 1e-6)

    partials = linear.split_k_linear(x, w)
    assert isinstance(partials, linear.SplitK) and partials.shape == (rows, n)
    assert partials.parts.dtype == torch.float32 and partials.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(partials.sum().float(), F.linear(x, w).float(), atol=atol,
                               rtol=rtol)
    out, new_res = fused.add_rms_norm(partials, residual, norm_w, 1e-6)
    assert new_res is residual, "the sum goes into the residual in place, as without a split"
    for got, want in ((out, expected_out), (new_res, expected_res)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    return partials.parts.shape[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 100, 256])
def test_split_k_then_norm_matches_matmul_then_norm(triton_device, rows, dtype):
    # K=256 over 128 columns: few output tiles, so the split is as many as K's 64-wide
    # slices allow (4)
    assert check(rows, 256, 128, dtype, triton_device) == 4


def test_split_k_refuses_an_input_of_another_width():
    with pytest.raises(ValueError, match="512 columns for a weight of 256 inputs"):
        linear.split_k_linear(torch.randn(4, 512), torch.randn(128, 256))


@pytest.mark.parametrize("rows,k,n", [(257, 256, 64), (4, 96, 64), (4, 256, 48), (4, 64, 64),
                                      (0, 256, 64)])
def test_split_k_declines_what_it_does_not_pay_for_or_divide(rows, k, n):
    # more rows than its table; K or N off its tiles; K of one slice (no split); no rows
    x, w = torch.randn(rows, k), torch.randn(n, k)
    assert linear.split_k_linear(x, w) is None


def test_split_k_needs_the_triton_norm():
    assert select_kernels("triton", "torch").split_k_linear is None, "off unless asked"
    assert select_kernels("triton", "torch", split_k=True).split_k_linear is not None
    with pytest.raises(ValueError, match="split_k needs ops='triton'"):
        select_kernels("torch", "torch", split_k=True)


def test_split_k_is_on_with_the_triton_ops_on_one_rank(triton_interpreter):
    # its partials are summed by the Triton residual-add RMSNorm; under tensor parallelism
    # o_proj and down_proj are all-reduced, which needs their whole output
    model = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128,
    })
    split_k = lambda **kw: resolve_config(EngineConfig(device="cpu", **kw), model).split_k
    assert not split_k(), "the CPU's default kernels"
    assert split_k(fused_kernels=True)  # (Triton's interpreter here)
    assert not split_k(fused_kernels=True, tensor_parallel_size=2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 16, 40, 64, 128, 200, 256])
@pytest.mark.parametrize("k,n", [(2048, 1024), (3072, 1024), (4096, 4096), (12288, 4096)])
def test_gpu_split_k_at_model_shapes(rows, k, n, dtype):
    x = randn(rows, k, device="cuda", dtype=dtype, seed=1)
    w = randn(n, k, device="cuda", dtype=dtype, seed=2)
    if linear.split_k_linear(x, w) is None:  # 8B's 4,096 columns fill the GPU at many rows
        assert n == 4096 and rows > 16
        return
    check(rows, k, n, dtype, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16, 33, 64])
def test_small_linear_matches_matmul(triton_device, rows, dtype):
    # qkv_proj and gate_up_proj at few rows (triton.linear.small_linear): the plain output, in
    # the input's dtype, rounded once from an fp32 accumulator as cuBLAS rounds its own
    x = randn(rows, 256, device=triton_device, dtype=dtype, seed=1)
    w = randn(96, 256, device=triton_device, dtype=dtype, seed=2, scale=256 ** -0.5)
    y = linear.small_linear(x, w)
    assert y.dtype == dtype and y.shape == (rows, 96)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), atol=atol, rtol=rtol)


def test_small_linear_declines_what_it_does_not_take():
    w = torch.randn(64, 256)
    # more rows than its tiles; N off its tile; K off every tile; no rows; K above
    # SMALL_MAX_K (Qwen3-8B's 4,096: not measured)
    for rows, k, n in ((65, 256, 64), (4, 256, 48), (4, 24, 64), (0, 256, 64), (4, 4096, 64)):
        assert linear.small_linear(torch.randn(rows, k), torch.randn(n, k)) is None
    with pytest.raises(ValueError, match="512 columns for a weight of 256 inputs"):
        linear.small_linear(torch.randn(4, 512), w)


@pytest.fixture
def small_linear_calls(monkeypatch):
    """How many projections small_linear took (a list of one count), for engines built
    after it: their Kernels bind the counting function."""
    ran = [0]
    original = linear.small_linear

    def counted(x, weight):
        y = original(x, weight)
        ran[0] += y is not None
        return y

    monkeypatch.setattr(linear, "small_linear", counted)
    select_kernels.cache_clear()
    yield ran
    select_kernels.cache_clear()


ENGINE = dict(device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=64,
              fused_kernels=True, attention_backend="triton")


def test_engine_with_split_k_and_small_gemms_matches_transformers(
        tiny_model, hf_tiny_model, triton_interpreter, small_linear_calls, monkeypatch):
    # qkv_proj and gate_up_proj by small_linear (K=64 of the tiny models), o_proj and
    # down_proj split-K where they split: the tiny models' down_proj (K=128) splits in two,
    # Qwen3's o_proj too, Llama's (K=64) does not: both paths run in one model, the whole
    # layer in Triton launches
    summed = [0]
    original = fused._launch_norm

    def counted(*args):
        summed[0] += len(args) > 6 and args[6] is not None
        return original(*args)

    monkeypatch.setattr(fused, "_launch_norm", counted)
    llm = LLM(str(tiny_model), **ENGINE)
    assert llm.engine.config.split_k and "split-K" in llm.engine.config.summary()
    prompts = make_prompts(seed=5, count=3)
    out = [o.token_ids for o in llm.generate(prompts, greedy(5), use_tqdm=False)]
    assert summed[0] > 0, "no norm summed split-K partials"
    assert small_linear_calls[0] > 0, "no projection ran as small_linear"
    assert out == [hf_greedy(hf_tiny_model, p, 5) for p in prompts]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 16, 40, 64])
@pytest.mark.parametrize("k,n", [(1024, 4096), (1024, 6144), (4096, 6144), (4096, 24576)])
def test_gpu_small_linear_at_model_shapes(rows, k, n, dtype, monkeypatch):
    # Qwen3-0.6B's and 8B's qkv_proj and gate_up_proj (8B's above SMALL_MAX_K: lifted)
    monkeypatch.setattr(linear, "SMALL_MAX_K", 4096)
    x = randn(rows, k, device="cuda", dtype=dtype, seed=1)
    w = randn(n, k, device="cuda", dtype=dtype, seed=2, scale=k ** -0.5)
    y = linear.small_linear(x, w)
    assert y is not None and y.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y.float(), F.linear(x, w).float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
def test_gpu_engine_with_small_gemms_matches_transformers(tiny_model, hf_tiny_model,
                                                          small_linear_calls):
    # the defaults on a GPU: through CUDA graphs (the decode steps' projections) and PDL
    llm = LLM(str(tiny_model), device="cuda", dtype="float32", max_model_len=256,
              kv_cache_gib=1)
    assert llm.engine.config.split_k
    prompts = make_prompts(seed=5, count=6)
    out = [o.token_ids for o in llm.generate(prompts, greedy(8), use_tqdm=False)]
    assert small_linear_calls[0] > 0, "no projection ran as small_linear"
    assert out == [hf_greedy(hf_tiny_model, p, 8) for p in prompts]
