"""The one-pass Triton sampler against torch: greedy rows give argmax exactly (ties to the
lowest id), temperature rows follow softmax(logits / T) by a chi-square test; its noise's
-log2(u) is positive and accurate up to the largest uniform, and a token 60 nats below the
top is never drawn.

Each test runs in Triton's CPU interpreter and, marked gpu, compiled on CUDA (the
`triton_device` fixture); the CUDA cases of test_sampler.py go through this kernel via
`sample` too.
"""

import pytest
import torch

from tests.support import SMALL_LOGITS, assert_matches, triton_module

ts = triton_module("nanovllm.kernels.triton_sampling")
import triton  # noqa: E402 - after triton_module, which skips this module without triton
import triton.language as tl  # noqa: E402

neg_log2_uniform = ts.neg_log2_uniform


@triton.jit
def _neg_log2_kernel(u_ptr, out_ptr, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    u = tl.load(u_ptr + offs, mask=offs < n, other=0.5)
    tl.store(out_ptr + offs, neg_log2_uniform(u, FAST), mask=offs < n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_are_torch_argmax(triton_device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=gen).to(dtype)
    logits[1, 10] = logits[1, 250] = logits[1].max() + 1  # a tie: the lower id wins
    logits[2] = float("-inf")  # argmax of an all -inf row is id 0
    logits[3, :] = 0.0
    logits = logits.to(triton_device)
    out = ts.gumbel_argmax(logits, torch.zeros(6, device=triton_device), 1e-5)
    assert out.dtype == torch.int64
    assert out.cpu().tolist() == logits.float().argmax(-1).cpu().tolist()
    assert out[1].item() == 10 and out[2].item() == 0


def test_vocab_wider_than_one_tile_and_strided_rows(triton_device: str) -> None:
    # several tiles per row, a width that is not a power of two, rows with padding between
    # them (a slice of a wider tensor), and the maximum in the last partial tile
    wide = torch.randn(3, 9000 + 100)
    logits = wide[:, :9000]
    logits[0, 8999] = 100.0
    logits[2, 4096] = 100.0
    greedy = torch.zeros(3, device=triton_device)
    for splits in (None, 1, 3):
        out = ts.gumbel_argmax(logits.to(triton_device), greedy, 1e-5, num_splits=splits)
        assert out.cpu().tolist() == logits.argmax(-1).tolist()
    tie = torch.zeros(2, 9000)
    tie[:, [2500, 7000]] = 1.0  # equal maxima in different splits: the lower id wins
    out = ts.gumbel_argmax(tie.to(triton_device), greedy[:2], 1e-5, num_splits=4)
    assert out.tolist() == [2500, 2500]


def _sampler(method: str):
    # the one-pass samplers: this module's race, or triton_cdf_sampling's inverse CDF
    if method == "race":
        return ts.gumbel_argmax
    return triton_module("nanovllm.kernels.triton_cdf_sampling").inverse_cdf_sample


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("method,temperature,cpu_rows", [
    ("race", 0.6, 1500), ("inverse_cdf", 0.6, 800), ("inverse_cdf", 1.0, 800)])
def test_temperature_rows_follow_softmax(triton_device: str, method: str, temperature: float,
                                         cpu_rows: int) -> None:
    """Both one-pass samplers, by a chi-square test."""
    n = cpu_rows if triton_device == "cpu" else 50_000  # one interpreted program per row
    logits = SMALL_LOGITS.expand(n, -1).contiguous().to(triton_device)
    temps = torch.full((n,), temperature, device=triton_device)
    out = _sampler(method)(logits, temps, 1e-5, seed=1234)
    assert_matches(out, torch.softmax(SMALL_LOGITS.double() / temperature, -1))


def test_mixed_rows_and_fresh_noise_per_call(triton_device: str) -> None:
    n = 64
    logits = torch.randn(n, 40).to(triton_device)
    temps = torch.tensor([0.0, 1.0] * (n // 2), device=triton_device)
    a = ts.gumbel_argmax(logits, temps, 1e-5)
    b = ts.gumbel_argmax(logits, temps, 1e-5)
    greedy = logits.argmax(-1)
    assert torch.equal(a[0::2], greedy[0::2]) and torch.equal(b[0::2], greedy[0::2])
    assert not torch.equal(a[1::2], b[1::2])  # a new seed per call
    same = ts.gumbel_argmax(logits, temps, 1e-5, seed=7)
    assert torch.equal(same, ts.gumbel_argmax(logits, temps, 1e-5, seed=7))
    # the noise is keyed by token id, so the split count does not change the draw
    assert torch.equal(same, ts.gumbel_argmax(logits, temps, 1e-5, seed=7, num_splits=3))


@pytest.mark.parametrize("method", ["race", "inverse_cdf"])
def test_vocabularies_smaller_than_a_tile(triton_device, method):
    """Both one-pass samplers."""
    sample = _sampler(method)
    greedy = torch.zeros(3, device=triton_device)
    for vocab in (1, 2, 5):
        logits = torch.randn(3, vocab)
        out = sample(logits.to(triton_device), greedy, 1e-5)
        assert out.cpu().tolist() == logits.argmax(-1).tolist()
        hot = sample(logits.to(triton_device), greedy + 1.0, 1e-5)
        assert ((0 <= hot) & (hot < vocab)).all()


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's log2(0)
def test_the_noise_logarithm_near_one(triton_device):
    """-log2(u) of the race, over the uniforms Triton draws (multiples of 2^-31 below
    1 - 2^-24): positive and accurate where u is close to 1, where the GPU's approximate
    lg2 alone could give 0 (a sure win for whatever token drew it) or a negative value."""
    tops = [1 - 2.0**-k for k in range(8, 25)]  # 1 - 2^-24 is the largest uniform
    u = torch.tensor([0.0, 2.0**-31, 1e-6, 0.25, 0.5, 0.75, 0.999, *tops], dtype=torch.float32)
    out = torch.empty_like(u, device=triton_device)
    fast = triton_device == "cuda"  # the launcher's FAST_LOG
    _neg_log2_kernel[(1,)](u.to(triton_device), out, u.numel(), FAST=fast, BLOCK=32)
    got, want = out.cpu().double(), -torch.log2(u.double())
    assert got[0] == float("inf")
    assert (got[1:] > 0).all() and torch.isfinite(got[1:]).all(), got
    # the approximate lg2 (2^-22 absolute on [0.5, 2]) is used only where -log2(u) > 1.4e-3
    torch.testing.assert_close(got[1:], want[1:], rtol=2e-4 if fast else 1e-6, atol=0)


@pytest.mark.gpu
def test_a_token_far_below_the_top_is_never_drawn():
    """A 152k vocabulary, one token 60 nats above the rest: exact sampling draws another
    with probability ~1e-21, so every draw is that token. ~2e8 draws: the top 2^-22 of
    the uniforms come up ~50 times, where an approximate -log2(u) of 0 would hand the
    race to a random token."""
    logits = torch.zeros(64, 151936, device="cuda", dtype=torch.bfloat16)
    logits[:, 7] = 60.0
    temps = torch.ones(64, device="cuda")
    for _ in range(20):
        out = ts.gumbel_argmax(logits, temps, 1e-5)
        assert (out == 7).all(), out[out != 7]
