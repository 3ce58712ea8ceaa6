"""Paged attention in plain torch: the CPU backend and the reference for the GPU kernels.

A cache of bytes (uint8) holds float8 e4m3 values (kv_cache_dtype="fp8", worker/kv_cache.py
KVFormat): its last dimension is `fp8_width` (the token-head's float32 scale after its
values, padded to 16 bytes). K/V are quantized as they
are stored and dequantized as a row's context is read, to the query's dtype. An fp8 V cache
may be stored transposed within each block (`v_transposed`; worker/kv_cache.py): the same
logical view, its rows gathered and written through it here. An fp8 K cache may keep
each block-head's scales in a plane after its values (`k_scale_plane`), whose view's strides
cannot say where every byte is: it is read and written through views of its own.
"""

import torch
import torch.nn.functional as F

from nanovllm.kernels.attention_metadata import AttentionMetadata

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def fp8_width(head_dim: int) -> int:
    """Bytes per token-head of an fp8 cache: the values and their float32 scale, padded to a
    multiple of 16 bytes. Unpadded (head_dim + 4), the rows' stride is not a
    multiple of 16, and Triton loads the tiles a byte at a time instead of in 16-byte vectors
    (seen in the decode kernel's PTX for sm_90: 128 ld.global.b8 and no cp.async)."""
    return -(-(head_dim + 4) // 16) * 16


def quantize_fp8(x: torch.Tensor, width: int) -> torch.Tensor:
    """[T, H, D] -> the cache's bytes [T, H, width]: float8 values, then each token-head's
    float32 scale amax / 448, so its largest value maps to 448, and zero padding.
    NaN is stored as 0 and infinities as the largest float32s, so every byte is finite."""
    dim = x.shape[-1]
    x = torch.nan_to_num(x.float())  # the cache holds finite bytes only (NaN -> 0)
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    values = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    pad = values.new_zeros(*values.shape[:-1], width - dim - 4)
    return torch.cat([values, scale.view(torch.uint8), pad], -1)


def dequantize_fp8(raw: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The cache's bytes [..., width] -> values [..., dim] in `dtype`."""
    values = raw[..., :dim].view(FP8).float()
    scales = raw[..., dim:dim + 4].contiguous().view(torch.float32)[..., 0]
    return (values * scales[..., None]).to(dtype)


def _read(raw: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_fp8(raw, dim, dtype) if raw.dtype == torch.uint8 else raw


def v_transposed(cache: torch.Tensor) -> bool:
    """Whether a cache is stored transposed within each block (an fp8 V cache, see
    worker/kv_cache.py): its [blocks, block_size, Hkv, width] view then has unit stride over
    the block's slots, which no row-major cache has."""
    return cache.dim() == 4 and cache.stride(1) == 1 and cache.shape[1] > 1


def k_scale_plane(cache: torch.Tensor) -> bool:
    """Whether an fp8 K cache keeps each block-head's float32 scales in a plane after its
    values (beside a V stored transposed, worker/kv_cache.py): a head's block is
    [block_size, head_dim] value bytes, then [block_size] scales, so reading it skips the
    rows' 16-byte padding.
    Its [blocks, block_size, Hkv, width] view steps positions by head_dim bytes, fewer than
    its width, which no other layout does; the view's bytes past head_dim are not its own
    (read and written here through `scale_plane_parts`)."""
    return cache.dim() == 4 and cache.dtype == torch.uint8 and 1 < cache.stride(1) < cache.shape[-1]


def scale_plane_view(cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """An fp8 K cache's [blocks, block_size, Hkv, width] bytes, each block-head's contiguous
    (head-major), seen in the scale-plane layout (`k_scale_plane`)."""
    nb, bs, heads, width = cache.shape
    sb, _, sh, _ = cache.stride()
    assert (heads == 1 or sh == bs * width) and width >= head_dim + 4, "head-major scaled rows"
    return cache.as_strided((nb, bs, heads, width), (sb, head_dim, sh, 1),
                            cache.storage_offset())


def scale_plane_parts(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A scale-plane cache's (values [blocks, block_size, Hkv, head_dim], scale bytes
    [blocks, block_size, Hkv, 4]), two views that do not overlap."""
    nb, bs, heads, _ = cache.shape
    sb, dim, sh, _ = cache.stride()
    values = cache.as_strided((nb, bs, heads, dim), (sb, dim, sh, 1), cache.storage_offset())
    scales = cache.as_strided((nb, bs, heads, 4), (sb, 4, sh, 1),
                              cache.storage_offset() + bs * dim)
    return values, scales


def _gather(cache: torch.Tensor, at) -> torch.Tensor:
    """`cache[at]` in the reference's row format, through a scale plane's two views."""
    if k_scale_plane(cache):
        values, scales = (part[at] for part in scale_plane_parts(cache))
        pad = values.new_zeros(*values.shape[:-1], cache.shape[-1] - values.shape[-1] - 4)
        return torch.cat([values, scales, pad], -1)
    return cache[at]


def _rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cache's [len(slots), Hkv, width] rows at `slots`."""
    if cache.is_contiguous():
        return cache.view(-1, *cache.shape[2:]).index_select(0, slots)
    block_size = cache.shape[1]
    return _gather(cache, (slots // block_size, slots % block_size))


def _blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The cache's blocks at `tables` [..., n]: [..., n, block_size, Hkv, width]."""
    return _gather(cache, tables)


def _write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    if cache.is_contiguous():
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)
        return
    block_size = cache.shape[1]
    pos = slots % block_size
    if k_scale_plane(cache):
        values, scales = scale_plane_parts(cache)
        dim = values.shape[-1]
        values[slots // block_size, pos] = rows[..., :dim]
        scales[slots // block_size, pos] = rows[..., dim:dim + 4]
    else:
        cache[slots // block_size, pos] = rows


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V ([T, Hkv, D]) into its cache slot (quantized for an fp8
    cache)."""
    width = k_cache.shape[-1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    if k_cache.dtype == torch.uint8:
        k, v = quantize_fp8(k, width), quantize_fp8(v, width)
    _write_rows(k_cache, slot_mapping, k)
    _write_rows(v_cache, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of q ([T, Hq, D]) over each row's cached context; returns [T, Hq, D].
    `fresh`: this step's K and V ([T, Hkv, D], as stored), which rows of more than one query
    token read for their own positions instead of the cache (over an fp8 cache: the values
    before rounding)."""
    if meta.query_lens_host == [1]:  # single-stream decode: no output buffer to fill
        k, v = _context(k_cache, v_cache, meta, 0, q)
        return _decode_one(q[0], k, v, scale)[None]
    out = torch.empty_like(q)
    starts = _host_starts(meta.query_lens_host)
    decode_rows = [i for i, n in enumerate(meta.query_lens_host) if n == 1]
    if len(decode_rows) > 1:
        _decode_batched(q, k_cache, v_cache, meta, scale, decode_rows, starts, out)
        done = set(decode_rows)
    else:
        done = set()
    for i, n in enumerate(meta.query_lens_host):
        if i in done or n == 0:
            continue
        k, v = _context(k_cache, v_cache, meta, i, q)
        if n == 1:  # one decode token sees its whole context: no mask, two small matmuls
            out[starts[i]] = _decode_one(q[starts[i]], k, v, scale)
            continue
        own = slice(starts[i], starts[i] + n)
        if fresh is not None:  # the row's own positions as computed, the cache's before them
            k = torch.cat([k[: k.shape[0] - n], fresh[0][own].to(q.dtype)])
            v = torch.cat([v[: v.shape[0] - n], fresh[1][own].to(q.dtype)])
        out[own] = _attend(q[own], k, v, scale, offset=k.shape[0] - n)
    return out


def _context(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, i: int,
             q: torch.Tensor):
    """Row i's cached K and V ([L, Hkv, D]), in context order, in q's dtype."""
    slots = _context_slots(meta, i, k_cache.shape[1])
    dim = q.shape[-1]
    return (_read(_rows(k_cache, slots), dim, q.dtype), _read(_rows(v_cache, slots), dim, q.dtype))


def _context_slots(meta: AttentionMetadata, i: int, block_size: int) -> torch.Tensor:
    """Cache slots of row i's context in order, computed once per step for all layers
    (`meta.derived`)."""
    slots = meta.derived.get(("slots", i))
    if slots is None:
        length = meta.context_lens_host[i]
        blocks = meta.block_tables[i, : -(-length // block_size)].long()
        offsets = torch.arange(block_size, device=blocks.device)
        slots = (blocks[:, None] * block_size + offsets).flatten()[:length]
        meta.derived[("slots", i)] = slots
    return slots


def _decode_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """One query ([Hq, D]) over its context ([L, Hkv, D]); each K/V head serves its group of
    query heads. A quarter of SDPA's host time on a CPU for one row."""
    heads, dim = q.shape
    kv_heads = k.shape[1]
    qg = q.view(kv_heads, heads // kv_heads, dim) * scale  # [Hkv, G, D]
    scores = torch.bmm(qg, k.permute(1, 2, 0))  # [Hkv, G, L]
    return torch.bmm(scores.softmax(-1), v.transpose(0, 1)).view(heads, dim)


def _host_starts(query_lens: list[int]) -> list[int]:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return starts


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int):
    """Causal attention of n queries that sit at positions offset..offset+n-1 of k/v."""
    n, length = q.shape[0], k.shape[0]
    gqa = q.shape[1] != k.shape[1]  # SDPA shares each K/V head with its group: no copies
    # [1, H, len, D]: SDPA's fused CPU kernel takes only 4-D inputs (3x the math path's speed)
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
    if offset == 0:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=n > 1, scale=scale,
                                           enable_gqa=gqa)
    else:
        pos_q = torch.arange(offset, offset + n, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= pos_q[:, None]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale,
                                           enable_gqa=gqa)
    return o[0].transpose(0, 1)


def _decode_batched(q, k_cache, v_cache, meta, scale, rows, starts, out) -> None:
    """All single-token rows at once: gather their blocks, pad, mask by context length."""
    block_size = k_cache.shape[1]
    max_len = max(meta.context_lens_host[i] for i in rows)
    num_blocks = -(-max_len // block_size)
    row_idx = torch.tensor(rows, device=q.device)
    tok_idx = torch.tensor([starts[i] for i in rows], device=q.device)
    tables = meta.block_tables[row_idx, :num_blocks].long()
    k = _read(_blocks(k_cache, tables).flatten(1, 2), q.shape[-1], q.dtype)  # [R, L, Hkv, D]
    v = _read(v_cache[tables].flatten(1, 2), q.shape[-1], q.dtype)
    lens = meta.context_lens[row_idx].to(q.device)
    mask = torch.arange(k.shape[1], device=q.device)[None, :] < lens[:, None]  # [R, L]
    qr = q[tok_idx].unsqueeze(2)  # [R, Hq, 1, D]
    o = F.scaled_dot_product_attention(
        qr, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :], scale=scale,
        enable_gqa=q.shape[1] != k.shape[2],
    )
    out[tok_idx] = o.squeeze(2)
