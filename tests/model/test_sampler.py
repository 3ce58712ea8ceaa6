"""The batched sampler (model/layers/sampler.py) against the definitions: greedy is argmax,
temperature / top-k / top-p / min-p follow their target distributions by a chi-square test,
seeded rows are reproducible whatever the batch, penalties and logprobs match a reference.
Each test taking `device` runs on the CPU and, marked gpu, on CUDA (there through the
one-pass Triton kernel where an engine would use it)."""

import dataclasses
import math
from collections import Counter

import pytest
import torch

from nanovllm.core.sampling_params import SamplingParams
from nanovllm.kernels import select_kernels
from nanovllm.model.layers.sampler import (
    MIN_TEMPERATURE,
    SamplerOutput,
    SamplingTensors,
    apply_bitmask,
    apply_penalties,
    sample,
    seeded_exponentials,
)
from nanovllm.worker.sampling import build_sampling_tensors
from tests.support import SMALL_LOGITS, assert_matches

N = 20_000


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def run(
    params: list[SamplingParams],
    logits: torch.Tensor,
    device: str,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    eos: frozenset[int] = frozenset(),
) -> SamplerOutput:
    prompts = prompts if prompts is not None else [[] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    t = build_sampling_tensors(params, prompts, outputs, set(eos), logits.shape[-1], device)
    # on CUDA as an engine samples there: batches that fit it in the one-pass kernel
    one_pass = select_kernels("triton").sample_one_pass if device == "cuda" else None
    return sample(logits.to(device), t, one_pass)


def reference_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """The target distribution straight from the definitions, in float64 Python."""
    p = torch.softmax(logits.double() / temperature, -1).tolist()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = order[:top_k] if top_k else order
    mass, kept = 0.0, []
    total = sum(p[i] for i in keep)
    for i in keep:  # smallest prefix whose renormalised mass reaches top_p
        if mass >= top_p:
            break
        kept.append(i)
        mass += p[i] / total
    p_max = max(p[i] for i in kept)
    kept = [i for i in kept if p[i] >= min_p * p_max]
    q = torch.zeros(len(p), dtype=torch.float64)
    q[kept] = torch.tensor([p[i] for i in kept], dtype=torch.float64)
    return q / q.sum()


def test_greedy_is_argmax(device: str) -> None:
    logits = torch.randn(16, 100)
    out = run([SamplingParams(temperature=0.0)] * 16, logits, device)
    assert torch.equal(out.token_ids.cpu(), logits.argmax(-1))
    mixed = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=5) for i in range(16)]
    out = run(mixed, logits, device)
    assert torch.equal(out.token_ids.cpu()[1::2], logits.argmax(-1)[1::2])


def test_tiny_temperature_is_near_greedy(device: str) -> None:
    logits = torch.randn(64, 50) * 50
    out = run([SamplingParams(temperature=1e-30)] * 64, logits, device)
    assert torch.equal(out.token_ids.cpu(), logits.argmax(-1))


def test_full_softmax_when_filters_off(device: str) -> None:
    params = [SamplingParams(top_p=1.0, top_k=0, min_p=0.0)] * N
    out = run(params, SMALL_LOGITS.expand(N, -1), device)
    assert_matches(out.token_ids, torch.softmax(SMALL_LOGITS.double(), -1))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_logits(device: str, temperature: float) -> None:
    out = run([SamplingParams(temperature=temperature)] * N, SMALL_LOGITS.expand(N, -1), device)
    assert_matches(out.token_ids, torch.softmax(SMALL_LOGITS.double() / temperature, -1))


@pytest.mark.parametrize(
    "filters",
    [
        {"top_k": 3},
        {"top_p": 0.7},
        {"min_p": 0.1},
        {"temperature": 0.8, "top_k": 6, "top_p": 0.9, "min_p": 0.05},
        {"temperature": 1.5, "top_k": 7, "top_p": 0.8},
    ],
)
def test_filters_match_definition(device: str, filters: dict) -> None:
    out = run([SamplingParams(**filters)] * N, SMALL_LOGITS.expand(N, -1), device)
    assert_matches(out.token_ids, reference_probs(SMALL_LOGITS, **filters))


def test_seeded_rows_follow_distribution(device: str) -> None:
    """The hashed randomness is good enough: across seeds and across offsets."""
    target = reference_probs(SMALL_LOGITS, top_k=7)
    by_seed = run([SamplingParams(seed=s, top_k=7) for s in range(N)],
                  SMALL_LOGITS.expand(N, -1), device)
    assert_matches(by_seed.token_ids, target)
    outputs = [[0] * i for i in range(2000)]  # offsets 0..1999 of one seed
    by_offset = run([SamplingParams(seed=7, top_k=7)] * 2000, SMALL_LOGITS.expand(2000, -1),
                    device, outputs=outputs)
    assert_matches(by_offset.token_ids, target)


@pytest.mark.parametrize("filters", [{}, {"temperature": 0.9, "top_k": 20, "top_p": 0.95}])
def test_seeded_row_independent_of_batch(device: str, filters: dict) -> None:
    vocab = 64
    logits = torch.randn(vocab) * 0.5
    target = SamplingParams(seed=1234, **filters)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(seed=99, min_p=0.2),
        SamplingParams(top_k=3, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=1.7, top_p=0.5, min_tokens=5, stop_token_ids=[3]),
    ]
    alone, batched = [], []
    for offset in range(30):
        out_ids = [1] * offset
        torch.manual_seed(offset)
        alone.append(run([target], logits[None], device, outputs=[out_ids]).token_ids.item())
        torch.manual_seed(1000 + offset)
        params = others[:2] + [target] + others[2:]
        batch_logits = torch.randn(5, vocab)
        batch_logits[2] = logits
        out = run(
            params,
            batch_logits,
            device,
            prompts=[[5, 6]] * 5,
            outputs=[[2] * 3, [], out_ids, [4, 4], [1]],
            eos={0},
        )
        batched.append(out.token_ids[2].item())
    assert alone == batched
    assert len(set(alone)) > 5  # the offset moves the stream


def test_seeds_differ_and_unseeded_rows_vary(device: str) -> None:
    logits = torch.zeros(200, 64)
    seeded = run([SamplingParams(seed=s) for s in range(200)], logits, device).token_ids
    assert len(set(seeded.tolist())) > 40
    same_seed = run([SamplingParams(seed=5)] * 200, logits, device).token_ids
    assert len(set(same_seed.tolist())) == 1
    first = run([SamplingParams()] * 200, logits, device).token_ids
    second = run([SamplingParams()] * 200, logits, device).token_ids
    assert len(set(first.tolist())) > 40
    assert not torch.equal(first, second)


def test_seeded_path_without_row_index_agrees(device: str) -> None:
    params = [SamplingParams(seed=s if s % 3 else None, top_p=0.9) for s in range(12)]
    params[0] = SamplingParams(seed=0, top_p=0.9)  # seed 0 is a seed like any other
    t = build_sampling_tensors(params, [[]] * 12, [[0] * s for s in range(12)], set(), 32, device)
    logits = torch.randn(12, 32, device=device)
    fast = sample(logits, t).token_ids
    slow = sample(logits, dataclasses.replace(t, seeded_rows=None)).token_ids
    seeded = torch.tensor([s % 3 != 0 or s == 0 for s in range(12)], device=device)
    assert torch.equal(fast[seeded], slow[seeded])
    # seeds 0 and 1 draw differently, and the same on both paths
    flat = torch.zeros(64, 1000, device=device)
    for seed in (0, 1):
        same = [SamplingParams(seed=seed, top_p=0.99)] * 64
        t = build_sampling_tensors(same, [[]] * 64, [[0] * i for i in range(64)], set(), 1000,
                                   device)
        draws = sample(flat, dataclasses.replace(t, seeded_rows=None)).token_ids
        assert torch.equal(draws, sample(flat, t).token_ids)
        if seed == 0:
            zero = draws
    assert not torch.equal(zero, draws)


@pytest.mark.gpu
def test_seeded_tokens_match_across_devices() -> None:
    params = [SamplingParams(seed=s, temperature=0.8, top_p=0.95) for s in range(64)]
    logits = torch.randn(64, 1000)
    outputs = [[0] * (s % 7) for s in range(64)]
    cpu = run(params, logits, "cpu", outputs=outputs).token_ids
    cuda = run(params, logits, "cuda", outputs=outputs).token_ids.cpu()
    assert torch.equal(cpu, cuda)


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_seed_hash_matches_python_reference(device: str) -> None:
    """Bit-exact against plain Python integers, including seeds and offsets past 2**32."""
    seeds = [0, 1, 2**32 + 5, 2**63 - 1]
    offsets = [0, 7, 2**40 + 3, 123]
    got = seeded_exponentials(
        torch.tensor(seeds, device=device), torch.tensor(offsets, device=device), 50
    ).cpu()
    for row, (seed, offset) in enumerate(zip(seeds, offsets, strict=True)):
        key = _fmix32((seed & 0xFFFFFFFF) ^ 0x5BD1E995)
        for word in (seed >> 32, offset & 0xFFFFFFFF, offset >> 32):
            key = _fmix32(key ^ word)
        key2 = _fmix32(key ^ 0x27D4EB2F)
        us = []
        for tok in range(50):
            h = _fmix32(_fmix32(key ^ ((tok * 0x9E3779B1) & 0xFFFFFFFF)) ^ key2)
            us.append(((h >> 9) * 2 + 1) * 2.0**-24)  # exact in float32
        assert got[row].tolist() == pytest.approx([-math.log(u) for u in us], rel=1e-6)
        # the same float32 u through the same log: equal to the bit
        want = -torch.tensor(us, dtype=torch.float32, device=device).log().cpu()
        assert torch.equal(got[row], want)


def _reference_penalties(logits, params, prompts, outputs):  # noqa: ANN001, ANN202
    out = logits.clone()
    for row, (p, prompt, output) in enumerate(zip(params, prompts, outputs, strict=True)):
        counts = Counter(output)
        for tok in range(logits.shape[1]):
            x = out[row, tok].item()
            if tok in counts or tok in prompt:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= p.frequency_penalty * counts[tok] + p.presence_penalty * (counts[tok] > 0)
            out[row, tok] = x
    return out


def test_penalties_match_reference(device: str) -> None:
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(presence_penalty=1.2),
        SamplingParams(frequency_penalty=0.4),
        SamplingParams(repetition_penalty=1.3, presence_penalty=-0.5, frequency_penalty=1.1),
        SamplingParams(),
    ]
    prompts = [[1, 2, 3], [3, 4], [5, 5, 6], [0], [7, 8], [1, 2]]
    outputs = [[2, 9, 9], [4, 10], [6, 6, 11], [12, 12, 12, 3], [8, 8, 13], [1, 1]]
    logits = torch.randn(6, 16) * 3
    t = build_sampling_tensors(params, prompts, outputs, set(), 16, device)
    got = apply_penalties(logits.to(device), t).cpu()
    want = _reference_penalties(logits, params, prompts, outputs)
    torch.testing.assert_close(got, want)
    assert (
        build_sampling_tensors(
            params[5:], prompts[5:], outputs[5:], set(), 16, device
        ).output_token_counts
        is None
    )


def test_penalty_steers_greedy(device: str) -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.5)]
    assert run(params, logits, device, outputs=[[]]).token_ids.item() == 1
    assert run(params, logits, device, outputs=[[1]]).token_ids.item() == 2


def test_min_tokens_masks_eos_and_stop_ids(device: str) -> None:
    logits = torch.zeros(4, 10)
    logits[:, 0] = 50.0  # EOS
    logits[:, 3] = 40.0  # stop id
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3]),
        SamplingParams(min_tokens=3, stop_token_ids=[3]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3], ignore_eos=True),
    ]
    outputs = [[5], [5, 5], [5, 5, 5], []]
    out = run(params, logits, device, outputs=outputs, eos={0}).token_ids.tolist()
    assert out[0] not in (0, 3) and out[1] not in (0, 3)
    assert out[2] == 0  # min_tokens reached: EOS is allowed again
    assert out[3] == 0  # ignore_eos: only the stop id is held back
    t = build_sampling_tensors(params, [[]] * 4, outputs, {0}, 10, device)
    assert t.min_tokens_mask is not None
    rows, cols = (x.tolist() for x in t.min_tokens_mask)
    assert sorted(zip(rows, cols, strict=True)) == [(0, 0), (0, 3), (1, 0), (1, 3), (3, 3)]
    done = build_sampling_tensors(params[2:3], [[]], outputs[2:3], {0}, 10, device)
    assert done.min_tokens_mask is None


def test_logprobs_are_raw_log_softmax(device: str) -> None:
    logits = torch.randn(5, 40) * 2
    params = [
        SamplingParams(temperature=0.7, top_k=5, logprobs=4),
        SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=2),
        SamplingParams(top_p=0.5, min_p=0.1, seed=3),
        SamplingParams(frequency_penalty=1.0, min_tokens=2, logprobs=0),
        SamplingParams(temperature=3.0),
    ]
    out = run(params, logits, device, prompts=[[1, 2]] * 5, outputs=[[3]] * 5, eos={0})
    want = torch.log_softmax(logits, -1)
    tokens = out.token_ids.cpu()
    torch.testing.assert_close(out.logprobs.cpu(), want.gather(1, tokens[:, None]).squeeze(1))
    assert out.top_logprobs is not None and out.top_logprob_ids is not None
    top, ids = want.topk(4, -1)
    torch.testing.assert_close(out.top_logprobs.cpu(), top)
    assert torch.equal(out.top_logprob_ids.cpu(), ids)
    assert run(params[2:], logits[2:], device).top_logprobs is None


def test_build_flags_and_offsets() -> None:
    params = [
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(seed=-5, top_k=1000),
        SamplingParams(seed=2**70, top_p=0.9),
    ]
    t = build_sampling_tensors(params, [[1]] * 3, [[], [1, 2], [3]], {0}, 100, "cpu")
    assert t.seed_offsets.tolist() == [0, 2, 1]
    assert t.top_ks.tolist() == [0, 100, 0]
    assert all(s >= 0 for s in t.seeds.tolist())
    assert t.seeded_rows is not None and t.seeded_rows.tolist() == [1, 2]
    assert (t.all_greedy, t.any_greedy, t.any_seeded) == (False, True, True)
    assert (t.any_top_k, t.any_top_p, t.any_min_p) == (False, True, False)
    assert t.output_token_counts is None and t.min_tokens_mask is None and t.max_logprobs == 0
    greedy = build_sampling_tensors(params[:1], [[1]], [[]], set(), 100, "cpu")
    assert greedy.all_greedy and not greedy.any_seeded and greedy.seeded_rows is None


def test_sample_never_syncs_with_host() -> None:
    """On the meta device any data-dependent step (.item(), nonzero, masks) would raise."""
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, logprobs=3),
        SamplingParams(seed=1, top_k=4, top_p=0.8, min_p=0.1, repetition_penalty=1.2),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.5),
    ]
    t = build_sampling_tensors(params, [[1, 2]] * 3, [[3]] * 3, {0}, 32, "meta")
    for tensors in (t, dataclasses.replace(t, seeded_rows=None)):
        out = sample(torch.empty(3, 32, device="meta"), tensors)
        assert out.token_ids.shape == (3,) and out.token_ids.dtype == torch.long
        assert out.top_logprobs is not None and out.top_logprobs.shape == (3, 3)


def test_dataclass_defaults_are_safe(device: str) -> None:
    """Hand-built tensors with default flags take every path and still sample right."""
    b = 4
    t = SamplingTensors(
        temperatures=torch.tensor([0.0, 1.0, 1.0, 1.0], device=device),
        top_ks=torch.tensor([0, 2, 0, 0], device=device),
        top_ps=torch.ones(b, device=device),
        min_ps=torch.zeros(b, device=device),
        seeds=torch.tensor([-1, -1, 3, -1], device=device),
        seed_offsets=torch.zeros(b, dtype=torch.long, device=device),
    )
    logits = torch.tensor([[0.0, 5.0, 1.0]] * b, device=device)
    tokens = sample(logits, t).token_ids.tolist()
    assert tokens[0] == 1 and tokens[1] in (1, 2)


class _OnePassSpy:
    """Stands in for the engine's one-pass kernel: records its arguments, picks argmax."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, float]] = []

    def __call__(self, logits, temperatures, min_temperature):
        self.calls.append((logits, temperatures, min_temperature))
        return logits.argmax(-1)


@pytest.mark.parametrize("params, fits", [
    ([SamplingParams(temperature=0.0)] * 3, True),
    ([SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)], True),
    ([SamplingParams(temperature=0.0, top_k=3)] * 2, True),  # all greedy: filters moot
    ([SamplingParams(temperature=0.0), SamplingParams(top_k=3)], False),
    ([SamplingParams(temperature=0.0), SamplingParams(top_p=0.9)], False),
    ([SamplingParams(temperature=0.0), SamplingParams(min_p=0.1)], False),
    ([SamplingParams(temperature=0.0), SamplingParams(seed=1)], False),
])
def test_one_pass_runs_exactly_for_greedy_and_plain_temperature_batches(params, fits):
    logits = torch.randn(len(params), 50).to(torch.bfloat16)
    t = build_sampling_tensors(params, [[]] * len(params), [[]] * len(params), set(), 50, "cpu")
    spy = _OnePassSpy()
    out = sample(logits, t, spy)
    assert len(spy.calls) == int(fits)
    if fits:
        got, temperatures, floor = spy.calls[0]
        assert got is logits, "a plain batch without logprobs: the logits as they are"
        assert torch.equal(temperatures, t.temperatures) and floor == MIN_TEMPERATURE
        assert torch.equal(out.token_ids, logits.argmax(-1)) and out.logprobs is None
    non_contiguous = torch.randn(50, len(params)).t()  # a view: the kernel needs stride 1
    spy = _OnePassSpy()
    sample(non_contiguous, t, spy)
    assert spy.calls == []


def test_one_pass_gets_float32_logits_when_a_penalty_alone_applies():
    logits = torch.randn(2, 30).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0)] * 2
    t = build_sampling_tensors(params, [[]] * 2, [[3], [4]], set(), 30, "cpu")
    spy = _OnePassSpy()
    sample(logits, t, spy)
    assert spy.calls[0][0].dtype == torch.float32


def test_one_pass_gets_penalized_masked_float32_logits_and_logprobs_stay_raw():
    logits = (torch.randn(2, 30) * 2).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.5, logprobs=2),
              SamplingParams(temperature=0.0, min_tokens=2)]
    outputs = [[4, 4, 9], [1]]
    t = build_sampling_tensors(params, [[]] * 2, outputs, {0}, 30, "cpu")
    spy = _OnePassSpy()
    out = sample(logits, t, spy)
    (got, _, _), = spy.calls
    want = apply_penalties(logits.float(), t).index_put(t.min_tokens_mask, torch.tensor(-math.inf))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    raw = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprobs.shape == (2, 2)


@pytest.mark.parametrize("any_logprobs, max_logprobs", [(True, 0), (False, 1), (True, 1)])
def test_logprobs_come_whenever_asked(any_logprobs, max_logprobs):
    logits = torch.randn(3, 20)
    t = build_sampling_tensors([SamplingParams(temperature=0.0)] * 3, [[]] * 3, [[]] * 3,
                               set(), 20, "cpu")
    t = dataclasses.replace(t, any_logprobs=any_logprobs, max_logprobs=max_logprobs)
    out = sample(logits, t)
    want = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, want.gather(1, out.token_ids[:, None]).squeeze(1))
    if max_logprobs:
        top, ids = want.topk(max_logprobs, -1)
        torch.testing.assert_close(out.top_logprobs, top)
        assert torch.equal(out.top_logprob_ids, ids)
    else:
        assert out.top_logprobs is None


def test_repetition_penalty_matches_transformers():
    """Every sign and size of logit, those in (0, 1] included, as transformers' processor
    penalizes them (over prompt and output together)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.linspace(-3, 3, 25).repeat(2, 1)
    seen = [list(range(0, 25, 2)), list(range(1, 25, 3))]
    params = [SamplingParams(repetition_penalty=1.7), SamplingParams(repetition_penalty=0.6)]
    t = build_sampling_tensors(params, [s[:3] for s in seen], [s[3:] for s in seen], set(),
                               25, "cpu")
    got = apply_penalties(logits.clone(), t)
    for row, (p, ids) in enumerate(zip(params, seen)):
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
            torch.tensor([ids]), logits[row : row + 1].clone())
        torch.testing.assert_close(got[row : row + 1], want)


def test_min_p_is_relative_to_each_rows_own_top_probability():
    peaked = torch.tensor([6.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # top p ~0.97
    flat = torch.tensor([0.0, 0.0, 0.1, 0.0, -5.0, -5.0])  # top p ~0.27: four within 0.5x
    logits = torch.stack([peaked, flat] * 200)
    params = [SamplingParams(min_p=0.5)] * 400
    t = build_sampling_tensors(params, [[]] * 400, [[]] * 400, set(), 6, "cpu")
    tokens = sample(logits, t).token_ids
    assert set(tokens[0::2].tolist()) == {0}
    assert set(tokens[1::2].tolist()) == {0, 1, 2, 3}  # drawn from all four, never 4 or 5
    t = build_sampling_tensors([SamplingParams(min_p=1.0)] * 400, [[]] * 400, [[]] * 400,
                               set(), 6, "cpu")
    assert set(sample(logits, t).token_ids[1::2].tolist()) == {2}  # min_p 1: the top only


def test_top_k_of_one_is_the_likeliest_token():
    logits = torch.randn(300, 40)
    t = build_sampling_tensors([SamplingParams(top_k=1, temperature=1.5)] * 300, [[]] * 300,
                               [[]] * 300, set(), 40, "cpu")
    assert torch.equal(sample(logits, t).token_ids, logits.argmax(-1))


def _bitmask(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """The structured-output bitmask of `allowed` ids per row, packed as llguidance packs
    it (bit i of int32 word j: token 32 j + i), built here from the definition."""
    words = (vocab + 31) // 32
    bits = [[0] * words for _ in allowed]
    for r, ids in enumerate(allowed):
        for t in ids:
            bits[r][t // 32] |= 1 << (t % 32)
    as_int32 = [[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in bits]
    return torch.tensor(as_int32, dtype=torch.int32)


def test_bitmask_forces_disallowed_tokens_to_minus_inf(device: str) -> None:
    vocab = 70  # not a multiple of 32: the last word's spare bits are ignored
    allowed = [[0, 31, 32, 63, 69], list(range(vocab)), [5]]
    logits = torch.randn(3, vocab)
    masked = apply_bitmask(logits.to(device), _bitmask(allowed, vocab).to(device)).cpu()
    for r, ids in enumerate(allowed):
        finite = torch.isfinite(masked[r]).nonzero().flatten().tolist()
        assert finite == sorted(ids)
        assert torch.equal(masked[r, ids], logits[r, ids])  # allowed logits untouched
    assert torch.isfinite(logits).all()  # a new tensor: the caller's logits are kept


def test_sampling_draws_only_allowed_tokens(device: str) -> None:
    """Greedy takes the best allowed token, sampling draws allowed tokens in proportion,
    and the mask holds with penalties, min_tokens and logprobs (raw: before the mask)."""
    vocab = 40
    logits = torch.randn(4, vocab) * 3
    logits[:, 7] = 30.0  # the best token, disallowed everywhere
    allowed = [[1, 2, 3], [4, 9, 33], [20], [0, 5, 6]]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.8, top_k=3, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, min_tokens=2, logprobs=1)]
    t = build_sampling_tensors(params, [[1]] * 4, [[5]] * 4, {0}, vocab, device)
    t.allowed = _bitmask(allowed, vocab).to(device)
    out = sample(logits.to(device), t)
    tokens = out.token_ids.tolist()
    assert tokens[0] == max(allowed[0], key=lambda i: logits[0, i])
    assert tokens[1] in allowed[1] and tokens[2] == 20
    assert tokens[3] in (5, 6)  # 0 is EOS, held back by min_tokens
    raw = torch.log_softmax(logits[3].double(), -1)[tokens[3]].item()
    assert out.logprobs[3].item() == pytest.approx(raw, abs=1e-4)
    draws = Counter()
    rows = 4000
    many = build_sampling_tensors([SamplingParams(temperature=1.0)] * rows, [[]] * rows,
                                  [[]] * rows, set(), vocab, device)
    many.allowed = _bitmask([allowed[1]] * rows, vocab).to(device)
    draws.update(sample(logits[1:2].expand(rows, -1).contiguous().to(device), many)
                 .token_ids.tolist())
    assert set(draws) <= set(allowed[1])
    p = torch.softmax(logits[1, allowed[1]].double(), -1)
    for i, t_id in enumerate(allowed[1]):
        assert abs(draws[t_id] / rows - p[i].item()) < 0.04
