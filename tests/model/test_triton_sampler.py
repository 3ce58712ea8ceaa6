"""The one-pass Triton sampler against torch: greedy rows give argmax exactly (ties to the
lowest id), temperature rows follow softmax(logits / T) by a chi-square test.

Each test runs in Triton's CPU interpreter and, marked gpu, compiled on CUDA (the
`triton_device` fixture); the CUDA cases of test_sampler.py go through this kernel via
`sample` too.
"""

import pytest
import torch

from tests.support import SMALL_LOGITS, assert_matches, triton_module

ts = triton_module("nanovllm.kernels.triton_sampling")


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


@pytest.mark.parametrize("temperature", [0.6])
def test_temperature_rows_follow_softmax(triton_device: str, temperature: float) -> None:
    n = 1500 if triton_device == "cpu" else 50_000  # one interpreted program per row
    logits = SMALL_LOGITS.expand(n, -1).contiguous().to(triton_device)
    temps = torch.full((n,), temperature, device=triton_device)
    out = ts.gumbel_argmax(logits, temps, 1e-5, seed=1234)
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


def test_vocabularies_smaller_than_a_tile(triton_device):
    greedy = torch.zeros(3, device=triton_device)
    for vocab in (1, 2, 5):
        logits = torch.randn(3, vocab)
        out = ts.gumbel_argmax(logits.to(triton_device), greedy, 1e-5)
        assert out.cpu().tolist() == logits.argmax(-1).tolist()
        hot = ts.gumbel_argmax(logits.to(triton_device), greedy + 1.0, 1e-5)
        assert ((0 <= hot) & (hot < vocab)).all()
