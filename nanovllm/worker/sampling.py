"""A step's sampling on one rank: the batch's per-row parameters as tensors, the sampler
(one pass over the logits for the common batch, the torch sampler otherwise), and the
sampled tokens' logprobs as dicts once they reach the host."""

from collections.abc import Sequence

import numpy as np
import torch

from nanovllm.core.sampling_params import SamplingParams
from nanovllm.core.sequence import Sequence as Seq
from nanovllm.kernels import Kernels
from nanovllm.model.layers.sampler import (
    MIN_TEMPERATURE,
    SamplerOutput,
    SamplingTensors,
    apply_bitmask,
    sample,
)

_SEED_MASK = 2**63 - 1  # any Python int seed maps into int64's non-negative range


def plain_temperatures(seqs: list[Seq]) -> list[float] | None:
    """The rows' temperatures if every row is greedy or plain temperature sampling (what
    the one-pass kernel samples), else None."""
    params = [s.sampling_params for s in seqs]
    return [p.temperature for p in params] if all(p.plain for p in params) else None


class StepSampler:
    """Samples one token per row of a step's logits on the device, with no host sync."""

    def __init__(
        self, kernels: Kernels, eos_token_ids: set[int], vocab_size: int, device: torch.device
    ) -> None:
        self.one_pass = kernels.sample_one_pass
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.device = device

    def one_pass_temperatures(self, seqs: list[Seq]) -> list[float] | None:
        """The rows' temperatures when the one-pass kernel samples this batch (every row
        greedy or plain temperature: the common batch), else None. They ride in the step
        inputs' copy (worker/inputs.py): no sampling tensors to build."""
        return None if self.one_pass is None else plain_temperatures(seqs)

    def sample(
        self, logits: torch.Tensor, seqs: list[Seq], temperatures: torch.Tensor | None = None,
        bitmask: np.ndarray | None = None,
    ) -> SamplerOutput:
        """Tokens for `seqs` (one per row of `logits`); `temperatures` on the device when
        `one_pass_temperatures` said yes; `bitmask`: the rows' allowed tokens under their
        structured-output constraints (engine/structured_output.py)."""
        allowed = None if bitmask is None else to_device(bitmask, torch.int32, self.device)
        if temperatures is not None:
            if allowed is not None:
                logits = apply_bitmask(logits, allowed)
            return SamplerOutput(self.one_pass(logits, temperatures, MIN_TEMPERATURE), None)
        params = [s.sampling_params for s in seqs]
        if any(p.uses_penalties for p in params):
            prompts = [s.token_ids[: s.num_prompt_tokens] for s in seqs]
            outputs = [s.output_token_ids for s in seqs]
        else:  # only the output lengths are read: skip copying every sequence's tokens
            prompts = [()] * len(seqs)
            outputs = [range(s.num_output_tokens) for s in seqs]
        tensors = build_sampling_tensors(
            params, prompts, outputs, self.eos_token_ids, logits.shape[-1], self.device
        )
        tensors.allowed = allowed
        return sample(logits, tensors, self.one_pass)


def logprob_dicts(
    out: SamplerOutput, seqs: list[Seq], token_ids: list[int]
) -> list[dict[int, float] | None] | None:
    """Per row: {sampled id: logprob, top ids: logprobs} for rows that asked, else None;
    None when no row asked (reads the device: call once the step has finished)."""
    if out.logprobs is None:
        return None
    entries: list[dict[int, float] | None] = [None] * len(seqs)
    lp = out.logprobs.tolist()
    top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    for i, seq in enumerate(seqs):
        k = seq.sampling_params.logprobs
        if k is None:
            continue
        entry = {token_ids[i]: lp[i]}
        if top_ids is not None:
            entry.update(zip(top_ids[i][:k], top_lps[i][:k], strict=True))
        entries[i] = entry
    return entries


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list/array as a device tensor without a host sync.

    A plain copy from pageable memory makes the host wait for every queued kernel, which
    would end CPU/GPU overlap; a copy from pinned memory (torch's caching host allocator,
    which keeps a buffer until its copy has run) is truly asynchronous.
    """
    if device.type != "cuda":
        if isinstance(data, np.ndarray):
            return torch.from_numpy(data).to(dtype)
        return torch.tensor(data, dtype=dtype, device=device)
    if isinstance(data, np.ndarray):
        host = torch.from_numpy(data).to(dtype).pin_memory()
    else:
        host = torch.tensor(data, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


def build_sampling_tensors(
    params: list[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    eos_token_ids: set[int],
    vocab_size: int,
    device: torch.device | str,
) -> SamplingTensors:
    """Turn one batch's per-row parameters and tokens into `SamplingTensors` on `device`.

    Row i samples output token number len(output_ids[i]), which is its seed offset.
    Penalty tensors are built only if some row uses penalties, and the min_tokens mask
    only if some row is still short of its min_tokens.
    """
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    seeded = [i for i in random_rows if params[i].seed is not None]
    # one host-to-device copy per dtype instead of one per field
    device = torch.device(device)
    floats = to_device(
        [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
        torch.float32,
        device,
    )
    ints = to_device(
        [
            [min(p.top_k, vocab_size) for p in params],
            [-1 if p.seed is None else p.seed & _SEED_MASK for p in params],
            [len(out) for out in output_ids],
        ],
        torch.long,
        device,
    )
    t = SamplingTensors(
        temperatures=floats[0],
        top_ps=floats[1],
        min_ps=floats[2],
        top_ks=ints[0],
        seeds=ints[1],
        seed_offsets=ints[2],
        min_tokens_mask=_min_tokens_mask(params, output_ids, eos_token_ids, vocab_size, device),
        seeded_rows=to_device(seeded, torch.long, device) if seeded else None,
        max_logprobs=max((p.logprobs or 0 for p in params), default=0),
        any_logprobs=any(p.logprobs is not None for p in params),
        all_greedy=not random_rows,
        any_greedy=len(random_rows) < len(params),
        any_seeded=bool(seeded),
        any_top_k=any(0 < params[i].top_k < vocab_size for i in random_rows),
        any_top_p=any(params[i].top_p < 1.0 for i in random_rows),
        any_min_p=any(params[i].min_p > 0.0 for i in random_rows),
    )
    if any(p.uses_penalties for p in params):
        _add_penalties(t, params, prompt_ids, output_ids, vocab_size, device)
    return t


def _add_penalties(
    t: SamplingTensors,
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    vocab_size: int,
    device: torch.device | str,
) -> None:
    penalties = to_device(
        [
            [p.repetition_penalty for p in params],
            [p.presence_penalty for p in params],
            [p.frequency_penalty for p in params],
        ],
        torch.float32,
        device,
    )
    t.repetition_penalties, t.presence_penalties, t.frequency_penalties = penalties.unbind(0)
    # rows without penalties contribute no tokens, so they ship and scatter nothing
    outputs = _padded(
        [out if p.uses_penalties else [] for p, out in zip(params, output_ids, strict=True)],
        vocab_size,
        device,
    )
    counts = torch.zeros(len(params), vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.int32))
    t.output_token_counts = counts[:, :vocab_size]
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = _padded(
            [
                ids if p.repetition_penalty != 1.0 else []
                for p, ids in zip(params, prompt_ids, strict=True)
            ],
            vocab_size,
            device,
        )
        mask = torch.zeros(len(params), vocab_size + 1, dtype=torch.bool, device=device)
        t.prompt_token_mask = mask.scatter_(1, prompts, True)[:, :vocab_size]


def _padded(rows: list[list[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    # pad with the id one past the vocab: it scatters into a spare column that is cut off
    width = max((len(r) for r in rows), default=0)
    return to_device(
        [r + [pad] * (width - len(r)) for r in rows], torch.long, torch.device(device)
    ).view(len(rows), width)


def _min_tokens_mask(
    params: list[SamplingParams],
    output_ids: list[list[int]],
    eos_token_ids: set[int],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    cols: list[int] = []
    for i, (p, out) in enumerate(zip(params, output_ids, strict=True)):
        if len(out) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            banned |= eos_token_ids
        ids = sorted(tok for tok in banned if tok < vocab_size)
        rows += [i] * len(ids)
        cols += ids
    if not rows:
        return None
    device = torch.device(device)
    return to_device(rows, torch.long, device), to_device(cols, torch.long, device)
