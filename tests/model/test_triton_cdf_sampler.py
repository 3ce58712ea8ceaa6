"""The inverse-CDF Triton sampler against torch: greedy rows give argmax exactly (ties to the
lowest id, in a tile and across tiles), temperature rows follow softmax(logits / T) by a
chi-square test over a small vocabulary and wherever the mass lies among the tiles of a
larger one, a draw does not depend on how the tiles are spread over programs, and a token
60 nats below the top is never drawn.

Each test runs in Triton's CPU interpreter and, marked gpu, compiled on CUDA (the
`triton_device` fixture); the CUDA cases of test_sampler.py go through this kernel via
`sample` (the engine's one-pass sampler).
"""

import pytest
import torch

from tests.support import SMALL_LOGITS, assert_matches, triton_module

cdf = triton_module("nanovllm.kernels.triton.sampling")
# the interpreter evaluates both sides of a where: -inf - -inf in the side not taken
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_are_torch_argmax(triton_device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3000, generator=gen).to(dtype)
    logits[1, 10] = logits[1, 2500] = logits[1].max() + 1  # a tie across tiles: lower id
    logits[5, 1030] = logits[5, 1029] = logits[5].max() + 1  # and in one tile
    logits[2] = float("-inf")  # argmax of an all -inf row is id 0
    logits[3, :] = 0.0
    logits[4, 2999] = 100.0  # the last id
    greedy = torch.zeros(6, device=triton_device)
    for splits in (None, 1, 3):
        out = cdf.sample_one_pass(logits.to(triton_device), greedy, 1e-5, num_splits=splits)
        assert out.dtype == torch.int64
        assert out.cpu().tolist() == logits.float().argmax(-1).tolist()


def test_temperature_rows_follow_softmax(triton_device: str) -> None:
    n = 800 if triton_device == "cpu" else 50_000  # one interpreted program per row
    logits = SMALL_LOGITS.expand(n, -1).contiguous().to(triton_device)
    temps = torch.full((n,), 0.6, device=triton_device)
    out = cdf.sample_one_pass(logits, temps, 1e-5, seed=1234)
    assert_matches(out, torch.softmax(SMALL_LOGITS.double() / 0.6, -1))


def test_mass_in_every_tile_and_none_in_some(triton_device: str) -> None:
    """A vocabulary of four tiles with its probable tokens spread across them, on their
    edges, a tile of tokens too unlikely to come up and most of one holding no mass at all
    (-inf): the draw must find the right tile and the right token in it. (Over 4 programs a
    row; the draw does not depend on their count: the test after this.)"""
    vocab, n = 4096, 800 if triton_device == "cpu" else 40_000
    logits = torch.full((vocab,), float("-inf"))
    hot = torch.tensor([0, 1023, 1024, 1500, 3071, 3072, 4095])  # about the tiles' edges
    logits[1024:2048] = -30.0  # a tile too unlikely to come up
    logits[2048:3071] = float("-inf")
    logits[hot] = torch.tensor([0.5, 1.0, -0.5, 0.0, 1.5, 0.2, -1.0])
    rows = logits.expand(n, -1).contiguous().to(triton_device)
    out = cdf.sample_one_pass(rows, torch.ones(n, device=triton_device), 1e-5, seed=99,
                              num_splits=4)
    probs = torch.softmax(logits.double(), -1)
    hits = torch.bincount(out.cpu(), minlength=vocab)
    assert hits[probs == 0].sum() == 0
    assert hits.sum() - hits[hot].sum() <= 3  # the -30 tile: ~2e-9 each, 1,024 of them
    assert_matches(torch.searchsorted(hot, out.cpu()), probs[hot] / probs[hot].sum())


def test_a_draw_does_not_depend_on_the_split_count(triton_device: str) -> None:
    n = 48
    logits = torch.randn(n, 2000).to(triton_device)
    temps = torch.tensor([0.0, 1.0, 0.7] * (n // 3), device=triton_device)
    a = cdf.sample_one_pass(logits, temps, 1e-5, seed=7, num_splits=1)
    assert torch.equal(a, cdf.sample_one_pass(logits, temps, 1e-5, seed=7, num_splits=1))
    assert torch.equal(a[0::3], logits.argmax(-1)[0::3])
    for splits in (2, 5):  # u is the row's; the same u names the same token
        assert torch.equal(a, cdf.sample_one_pass(logits, temps, 1e-5, seed=7,
                                                  num_splits=splits))
    fresh = [cdf.sample_one_pass(logits, temps, 1e-5) for _ in range(2)]
    assert not torch.equal(fresh[0], fresh[1])  # a new seed per call


def test_strided_rows(triton_device: str) -> None:
    wide = torch.randn(3, 1100)
    wide[:, 1000:] = 100.0  # padding after each row's 1,000 logits: never read
    logits = wide[:, :1000].to(triton_device)
    out = cdf.sample_one_pass(logits, torch.ones(3, device=triton_device), 1e-5)
    assert (out < 1000).all()


def test_vocabularies_smaller_than_a_tile(triton_device: str) -> None:
    greedy = torch.zeros(3, device=triton_device)
    for vocab in (1, 2, 5):
        logits = torch.randn(3, vocab)
        out = cdf.sample_one_pass(logits.to(triton_device), greedy, 1e-5)
        assert out.cpu().tolist() == logits.argmax(-1).tolist()
        hot = cdf.sample_one_pass(logits.to(triton_device), greedy + 1.0, 1e-5)
        assert ((0 <= hot) & (hot < vocab)).all()


@pytest.mark.gpu
def test_a_token_far_below_the_top_is_never_drawn():
    """A 152k vocabulary, one token 60 nats above the rest: exact sampling draws another
    with probability ~1e-21, so every draw is that token."""
    logits = torch.zeros(64, 151936, device="cuda", dtype=torch.bfloat16)
    logits[:, 7] = 60.0
    temps = torch.ones(64, device="cuda")
    for _ in range(20):
        out = cdf.sample_one_pass(logits, temps, 1e-5)
        assert (out == 7).all(), out[out != 7]
