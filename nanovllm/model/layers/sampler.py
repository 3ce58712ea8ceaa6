from collections.abc import Callable
from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
_TINY = torch.finfo(torch.float32).tiny
MIN_TEMPERATURE = 1e-5  # a floor that keeps logits / T finite


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one batch, as tensors on the logits' device.

    Rows are batch rows. temperature 0 means greedy; top_k 0, top_p 1 and min_p 0
    turn those filters off; seed -1 means unseeded. `seed_offsets` is the index of
    the output token being sampled, so a seeded row draws the same randomness for
    (seed, offset) whatever the batch looks like or however often it was preempted.
    The penalty fields are all None when no row uses penalties. `min_tokens_mask` is
    an index pair (rows, token_ids) of logits forced to -inf, None when empty. `allowed`
    is a structured-output bitmask (engine/structured_output.py): tokens whose bit is
    clear are forced to -inf.
    `seeded_rows` lists the random rows with a seed, so the hash runs on those only.
    The flags let common batches skip work; their defaults are the safe choice.
    """

    temperatures: torch.Tensor  # float32 [B]
    top_ks: torch.Tensor  # int64 [B]
    top_ps: torch.Tensor  # float32 [B]
    min_ps: torch.Tensor  # float32 [B]
    seeds: torch.Tensor  # int64 [B], in [0, 2**63) or -1
    seed_offsets: torch.Tensor  # int64 [B]
    repetition_penalties: torch.Tensor | None = None  # float32 [B]
    presence_penalties: torch.Tensor | None = None  # float32 [B]
    frequency_penalties: torch.Tensor | None = None  # float32 [B]
    output_token_counts: torch.Tensor | None = None  # int [B, V]
    prompt_token_mask: torch.Tensor | None = None  # bool [B, V]
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None  # int64 [N], [N]
    allowed: torch.Tensor | None = None  # int32 [B, ceil(V / 32)]: bit i of word j, id 32j+i
    seeded_rows: torch.Tensor | None = None  # int64 [S]
    max_logprobs: int = 0
    any_logprobs: bool = True  # some row wants the sampled token's logprob
    all_greedy: bool = False
    any_greedy: bool = True
    any_seeded: bool = True
    any_top_k: bool = True
    any_top_p: bool = True
    any_min_p: bool = True


@dataclass
class SamplerOutput:
    """Sampled tokens and their log-probs under the raw logits (see `sample`)."""

    token_ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None  # float32 [B]; None when no row asked for logprobs
    top_logprob_ids: torch.Tensor | None = None  # int64 [B, max_logprobs]
    top_logprobs: torch.Tensor | None = None  # float32 [B, max_logprobs]


def sample(
    logits: torch.Tensor, t: SamplingTensors, one_pass: Callable | None = None
) -> SamplerOutput:
    """Pick one token per row of `logits` [B, V], with no host sync.

    `one_pass` (the engine's `Kernels.sample_one_pass`, or None) samples batches of greedy
    and plain-temperature rows in one pass over the logits.

    Order: penalties, the structured-output mask, the min_tokens mask, then argmax for greedy
    rows; other rows divide by temperature, apply top-k, top-p, min-p and draw by an
    exponential race.
    Log-probs follow vLLM's default ("raw_logprobs"): log_softmax of the logits as
    the model returned them, before penalties, masks, temperature and filters.
    """
    if not _fits_one_pass(logits, t):
        one_pass = None
    plain = t.output_token_counts is None and t.min_tokens_mask is None and t.allowed is None
    want_logprobs = t.any_logprobs or t.max_logprobs > 0
    # the float32 copy is needed for penalties, masks, logprobs and the torch path
    raw = logits if one_pass and plain and not want_logprobs else logits.float()
    logits = apply_penalties(raw, t)
    if t.allowed is not None:
        logits = apply_bitmask(logits, t.allowed)
    if t.min_tokens_mask is not None:
        logits = logits.index_put(t.min_tokens_mask, logits.new_full((), float("-inf")))
    if one_pass:
        token_ids = one_pass(logits, t.temperatures, MIN_TEMPERATURE)
    elif t.all_greedy:
        token_ids = logits.argmax(-1)
    else:
        token_ids = _sample_random(logits, t)
        if t.any_greedy:
            token_ids = torch.where(t.temperatures == 0, logits.argmax(-1), token_ids)
    out = SamplerOutput(token_ids, None)
    if not want_logprobs:
        return out  # a full pass over [B, V] saved
    log_z = raw.logsumexp(-1, keepdim=True)
    out.logprobs = (raw.gather(1, token_ids[:, None]) - log_z).squeeze(1)
    if t.max_logprobs > 0:
        top, out.top_logprob_ids = raw.topk(min(t.max_logprobs, raw.shape[-1]), dim=-1)
        out.top_logprobs = top - log_z
    return out


def _fits_one_pass(logits: torch.Tensor, t: SamplingTensors) -> bool:
    """Greedy and temperature rows only (no top-k/top-p/min-p, no seeded rows)."""
    if logits.stride(-1) != 1:
        return False
    return t.all_greedy or not (t.any_top_k or t.any_top_p or t.any_min_p or t.any_seeded)


def apply_bitmask(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """`logits` [B, V] with every token whose bit in `bits` [B, ceil(V / 32)] is clear set
    to -inf (a new tensor: the caller's logits may be a CUDA graph's output)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits[:, :, None] >> shifts) & 1).view(bits.shape[0], -1)[:, : logits.shape[-1]]
    return logits.masked_fill(allowed == 0, float("-inf"))


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Repetition penalty (HF: over prompt and output), then presence and frequency
    penalties (OpenAI: over output only). Returns `logits` itself when none apply."""
    counts = t.output_token_counts
    if counts is None:
        return logits
    assert t.repetition_penalties is not None
    assert t.presence_penalties is not None and t.frequency_penalties is not None
    in_output = counts > 0
    seen = in_output if t.prompt_token_mask is None else in_output | t.prompt_token_mask
    rep = t.repetition_penalties[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - t.frequency_penalties[:, None] * counts
    return logits - t.presence_penalties[:, None] * in_output


def _sample_random(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    if not (t.any_top_k or t.any_top_p or t.any_min_p or t.any_seeded):
        return _gumbel_argmax(logits, t.temperatures)
    # a floor keeps tiny temperatures finite; greedy rows' picks are replaced by the caller
    logits = logits / t.temperatures.clamp_min(MIN_TEMPERATURE)[:, None]
    if t.any_top_k or t.any_top_p:
        logits = _apply_top_k_top_p(logits, t.top_ks, t.top_ps)
    probs = logits.softmax(-1)
    if t.any_min_p:
        threshold = t.min_ps[:, None] * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    # argmax of p_i / E_i with E_i ~ Exp(1) i.i.d. picks i with probability p_i / sum(p)
    return probs.div_(_exponentials(probs, t)).argmax(-1)


def _gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    # the same race without the softmax: argmax(p / E) = argmax(logits / T - log E)
    u = torch.rand_like(logits).clamp_(_TINY, 1.0)
    scaled = logits / temperatures.clamp_min(MIN_TEMPERATURE)[:, None]
    return (scaled - torch.log(-torch.log(u))).argmax(-1)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    vocab = logits.shape[-1]
    ordered, order = logits.sort(-1, descending=True)
    k = torch.where(top_ks > 0, top_ks, vocab).clamp(max=vocab)
    kth = ordered.gather(1, (k - 1)[:, None])
    ordered.masked_fill_(ordered < kth, float("-inf"))
    probs = ordered.softmax(-1)
    # keep a token while the mass before it is below top_p: the smallest set reaching top_p
    mass_before = probs.cumsum(-1) - probs
    drop = (mass_before >= top_ps[:, None]) & (top_ps < 1)[:, None]
    ordered.masked_fill_(drop, float("-inf"))
    # logits is the caller's own temporary, so it can take the result in place
    return logits.scatter_(1, order, ordered)


def _exponentials(probs: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    e = torch.empty_like(probs).exponential_()
    if t.any_seeded:
        vocab = probs.shape[-1]
        if t.seeded_rows is not None:
            rows = t.seeded_rows
            hashed = seeded_exponentials(t.seeds[rows], t.seed_offsets[rows], vocab)
            e.index_copy_(0, rows, hashed)
        else:
            hashed = seeded_exponentials(t.seeds.clamp(min=0), t.seed_offsets, vocab)
            e = torch.where((t.seeds >= 0)[:, None], hashed, e)
    # exponential_ may return exactly 0 on some backends, and 0 / 0 would be nan
    return e.clamp_min_(_TINY)


def seeded_exponentials(
    seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Exp(1) draws [S, V] that depend only on (seed, offset, token id).

    A counter-based hash (murmur3 fmix32 rounds) in int64 tensor ops: the integer
    stream is bit-identical on every device; the final float log may differ by an ulp.
    `seeds` and `offsets` are non-negative int64 [S].
    """
    key = _fmix32((seeds & _M32) ^ 0x5BD1E995)
    key = _fmix32(key ^ (seeds >> 32))
    key = _fmix32(key ^ (offsets & _M32))
    key = _fmix32(key ^ ((offsets >> 32) & _M32))
    key2 = _fmix32(key ^ 0x27D4EB2F)
    token = _mul32(torch.arange(vocab_size, device=seeds.device), 0x9E3779B1)
    h = _fmix32(_fmix32(key[:, None] ^ token) ^ key2[:, None])
    # 23 high bits as an odd multiple of 2**-24: exact in float32 and strictly inside (0, 1)
    u = ((h >> 9) * 2 + 1).float() * 2.0**-24
    return -u.log()


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # x * c mod 2**32 in two 16-bit halves, so no product leaves int64's range
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)
