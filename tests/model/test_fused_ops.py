"""Fused Triton norm / RoPE / SiLU kernels (kernels/triton/ops.py) against the torch
functions they replace (kernels/torch_ops.py), and a model built with either.

The small tests run on small fp32 / fp16 shapes in Triton's CPU interpreter and, marked gpu,
compiled on CUDA (the `triton_device` fixture); the other gpu tests repeat the checks at
Qwen3-0.6B..8B widths in bf16 / fp16. The kernels round to the activation dtype wherever
torch does, so the tolerances are a couple of ulps of that dtype.
"""

import dataclasses

import pytest
import torch

from nanovllm.kernels import select_kernels
from nanovllm.kernels import torch_ops as ref
from nanovllm.model.layers.rotary import RotaryEmbedding
from tests.support import triton_module

fused = triton_module("nanovllm.kernels.triton.ops")
# (atol, rtol): fp32 differs only by summation order; half dtypes by a rounding or two
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
CPU_DTYPES = [torch.float32, torch.float16]


def close(out: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOL[expected.dtype]
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out.cpu().float(), expected.cpu().float(), atol=atol, rtol=rtol)


def randn(*shape, device: str, dtype=torch.float32, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device, dtype)


def norm_weight(n: int, device: str, dtype=torch.float32, seed=1) -> torch.Tensor:
    return (1.0 + 0.1 * randn(n, device="cpu", seed=seed)).to(device, dtype)


def rope_tables(head_dim: int, max_position: int, device: str):
    rope = RotaryEmbedding(head_dim, max_position, 10000.0, None, select_kernels()).to(device)
    return rope.cos, rope.sin


def reference_qk(qkv, sizes, heads, positions, cos, sin, qw, kw, eps):
    """The unfused path of llama.py on a copy: split, view, optional q/k norm, RoPE."""
    q, k, _ = qkv.clone().split(sizes, dim=-1)
    (hq, hkv, d) = heads
    q, k = q.reshape(-1, hq, d), k.reshape(-1, hkv, d)
    if qw is not None:
        q, k = ref.rms_norm(q, qw, eps), ref.rms_norm(k, kw, eps)
    return ref.apply_rotary(positions, q, k, cos, sin)


def check_qk_norm_rope(tokens, hq, hkv, d, with_norm, dtype, device, max_pos=97):
    q_size, kv_size = hq * d, hkv * d
    sizes = [q_size, kv_size, kv_size]
    qkv = randn(tokens, q_size + 2 * kv_size, dtype=dtype, device=device)
    # positions spread over the whole table, both ends included
    positions = torch.randint(0, max_pos, (tokens,), generator=torch.Generator().manual_seed(3))
    positions[0] = max_pos - 1
    if tokens > 1:
        positions[1] = 0
    positions = positions.to(device)
    cos, sin = rope_tables(d, max_pos, device)
    qw = norm_weight(d, device, dtype, seed=4) if with_norm else None
    kw = norm_weight(d, device, dtype, seed=5) if with_norm else None
    eps = 1e-6
    expected_q, expected_k = reference_qk(
        qkv, sizes, (hq, hkv, d), positions, cos, sin, qw, kw, eps
    )
    v_before = qkv[:, q_size + kv_size :].clone()

    q, k, _ = qkv.split(sizes, dim=-1)
    q, k = q.view(-1, hq, d), k.view(-1, hkv, d)  # strided views into qkv, as in llama.py
    assert tokens == 1 or q.stride(0) == q_size + 2 * kv_size  # T=1 views get stride q_size
    out_q, out_k = fused.qk_norm_rope(q, k, positions, cos, sin, qw, kw, eps)
    assert out_q.data_ptr() == qkv.data_ptr() and out_k is k  # in place
    close(qkv[:, :q_size].view(-1, hq, d), expected_q)
    close(qkv[:, q_size : q_size + kv_size].view(-1, hkv, d), expected_k)
    assert torch.equal(qkv[:, q_size + kv_size :], v_before), "v must be untouched"


# ---------------------------------------------------------------------------------------
# small checks: in the interpreter, and compiled on CUDA


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 48), (5, 100), (3, 64)])
def test_rms_norm(triton_device, rows, width, dtype):
    x = randn(rows, width, device=triton_device, dtype=dtype) * 3
    w = norm_weight(width, triton_device, dtype)
    close(fused.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))


def test_rms_norm_strided_3d_input(triton_device):
    x = randn(4, 3, 40, device=triton_device)[:, :, 4:36]  # [T, H, D] with gaps, like a q view
    w = norm_weight(32, triton_device)
    out = fused.rms_norm(x, w, 1e-5)
    assert out.shape == x.shape and out.is_contiguous()
    close(out, ref.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 48), (6, 100)])
def test_add_rms_norm_updates_residual_in_place(triton_device, rows, width, dtype):
    x = randn(rows, width, device=triton_device, dtype=dtype, seed=1)
    residual = randn(rows, width, device=triton_device, dtype=dtype, seed=2) * 2
    w = norm_weight(width, triton_device, dtype)
    x_before, res_before = x.clone(), residual.clone()
    expected_out, expected_res = ref.add_rms_norm(x_before, res_before, w, 1e-6)

    out, new_res = fused.add_rms_norm(x, residual, w, 1e-6)
    assert new_res is residual, "a contiguous residual of the right dtype is updated in place"
    close(out, expected_out)
    close(new_res, expected_res)
    assert torch.equal(x, x_before), "x is only read"


def test_add_rms_norm_strided_residual_gets_a_new_tensor(triton_device):
    x = randn(3, 40, device=triton_device, seed=1)
    # not contiguous: cannot be written through a view
    residual = randn(40, 3, device=triton_device, seed=2).t()
    res_before = residual.clone()
    w = norm_weight(40, triton_device)
    out, new_res = fused.add_rms_norm(x, residual, w, 1e-6)
    expected_out, expected_res = ref.add_rms_norm(x, res_before, w, 1e-6)
    assert new_res is not residual and torch.equal(residual, res_before)
    close(out, expected_out)
    close(new_res, expected_res)


@pytest.mark.parametrize("with_norm", [True, False], ids=["qk_norm", "rope_only"])
@pytest.mark.parametrize(
    "tokens,hq,hkv,d",
    [(1, 4, 2, 32), (7, 3, 1, 24), (5, 6, 2, 40)],  # last two: non-power-of-two heads / half
)
def test_qk_norm_rope(triton_device, tokens, hq, hkv, d, with_norm):
    check_qk_norm_rope(tokens, hq, hkv, d, with_norm, torch.float32, triton_device)


@pytest.mark.parametrize("with_norm", [True, False], ids=["qk_norm", "rope_only"])
def test_qk_norm_rope_fp16(triton_device, with_norm):
    check_qk_norm_rope(6, 4, 2, 32, with_norm, torch.float16, triton_device)


def test_qk_norm_rope_int32_positions_and_empty_batch(triton_device):
    cos, sin = rope_tables(16, 20, triton_device)
    q = randn(3, 2, 16, device=triton_device, seed=1)
    k = randn(3, 1, 16, device=triton_device, seed=2)
    pos = torch.tensor([19, 0, 7], device=triton_device)
    expected = ref.apply_rotary(pos, q, k, cos, sin)
    out = fused.qk_norm_rope(q.clone(), k.clone(), pos.to(torch.int32), cos, sin)
    close(out[0], expected[0])
    close(out[1], expected[1])
    empty = fused.qk_norm_rope(q[:0], k[:0], pos[:0], cos, sin)
    assert empty[0].shape == (0, 2, 16)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 40), (4, 1500)])  # 1500: two column programs
def test_silu_and_mul(triton_device, rows, width, dtype):
    x = randn(rows, 2 * width, device=triton_device, dtype=dtype) * 3
    close(fused.silu_and_mul(x), ref.silu_and_mul(x))


def test_kernel_choice_is_a_value_not_a_switch():
    triton = select_kernels("triton", "torch")
    torch_ = select_kernels("torch", "torch")
    assert triton.rms_norm is fused.rms_norm and triton.qk_norm_rope is fused.qk_norm_rope
    assert triton.sample_one_pass is not None
    assert torch_.rms_norm is ref.rms_norm and torch_.sample_one_pass is None
    assert select_kernels("triton", "torch") is triton, "equal choices share their callables"
    with pytest.raises(ValueError, match="unknown kernels"):
        select_kernels("cuda", "torch")


def tiny_qwen3(qk_norm: bool, kernels, device: str):
    from nanovllm.model.config import ModelConfig
    from nanovllm.model.models.llama import LlamaForCausalLM

    cfg = ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=64,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=qk_norm,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, max_position=32, kernels=kernels)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p)
            )
    return model.to(device)


def prefill_meta(lens: list[int], block_size: int, device: str):
    from nanovllm.kernels.attention_metadata import AttentionMetadata

    blocks = [-(-n // block_size) for n in lens]
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    slots, first = [], 0
    for i, (n, nb) in enumerate(zip(lens, blocks)):
        tables[i, :nb] = torch.arange(first, first + nb)
        slots += [first * block_size + j for j in range(n)]
        first += nb
    starts = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=starts.to(device),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_query_len=max(lens),
        max_context_len=max(lens),
        query_lens_host=list(lens),
        context_lens_host=list(lens),
    )
    return meta, first


def prefill_logits(model, device: str) -> torch.Tensor:
    """The logits of a prefill of two sequences (5 and 3 tokens) into a fresh paged cache."""
    lens, block_size = [5, 3], 4
    meta, num_blocks = prefill_meta(lens, block_size, device)
    ids = torch.randint(0, 64, (sum(lens),), generator=torch.Generator().manual_seed(7))
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    for attn in model.attention_layers():
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        attn.k_cache = torch.zeros(shape, device=device)
        attn.v_cache = torch.zeros(shape, device=device)
    with torch.inference_mode():
        return model.compute_logits(model(ids.to(device), positions, meta))


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_tiny_model_logits_same_with_fusion_on_and_off(triton_device, qk_norm):
    device = triton_device

    def logits(model) -> torch.Tensor:
        return prefill_logits(model, device)

    calls = {name: 0 for name in ("rms_norm", "add_rms_norm", "qk_norm_rope", "silu_and_mul")}

    def counted(name):
        def call(*args, **kw):
            calls[name] += 1
            return getattr(fused, name)(*args, **kw)

        return call

    # the fused model's ops, counted; the same weights (same seed) with torch's
    kernels = dataclasses.replace(
        select_kernels("triton", "torch"), **{name: counted(name) for name in calls}
    )
    unfused = logits(tiny_qwen3(qk_norm, select_kernels("torch", "torch"), device))
    assert not any(calls.values())
    with_fusion = logits(tiny_qwen3(qk_norm, kernels, device))
    # per layer: 2 norms (the first layer's first one without a residual), 1 q/k, 1 MLP
    layers = 2
    assert calls == {
        "rms_norm": 1,
        "add_rms_norm": 2 * layers,
        "qk_norm_rope": layers,
        "silu_and_mul": layers,
    }
    torch.testing.assert_close(with_fusion, unfused, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------
# real sizes and dtypes on a GPU


GPU_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("rows", [1, 37, 2048])
@pytest.mark.parametrize("width", [1024, 2560, 4096, 5120, 8192])
def test_gpu_norms(rows, width, dtype):
    x = randn(rows, width, device="cuda", dtype=dtype, seed=1)
    residual = randn(rows, width, device="cuda", dtype=dtype, seed=2)
    w = norm_weight(width, "cuda", dtype)
    close(fused.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    expected_out, expected_res = ref.add_rms_norm(x, residual.clone(), w, 1e-6)
    out, new_res = fused.add_rms_norm(x, residual, w, 1e-6)
    close(out, expected_out)
    close(new_res, expected_res)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("with_norm", [True, False], ids=["qk_norm", "rope_only"])
@pytest.mark.parametrize("tokens", [1, 64, 3000])
@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (32, 8, 128), (14, 2, 64), (40, 8, 80)])
def test_gpu_qk_norm_rope(tokens, hq, hkv, d, with_norm, dtype):
    check_qk_norm_rope(tokens, hq, hkv, d, with_norm, dtype, "cuda", max_pos=40960)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("rows", [1, 37, 2048])
@pytest.mark.parametrize("width", [3072, 4864, 12288])
def test_gpu_silu_and_mul(rows, width, dtype):
    x = randn(rows, 2 * width, device="cuda", dtype=dtype) * 3
    close(fused.silu_and_mul(x), ref.silu_and_mul(x))
