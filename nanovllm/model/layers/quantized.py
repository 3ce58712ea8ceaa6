"""Weights that stay quantized on the CPU: GGUF's 4- and 8-bit blocks in forms torch's packed
CPU kernels take, so a decode step reads ~4x fewer weight bytes than float32.

A GGUF Q4_0 / Q4_1 block holds 32 weights as 4-bit values q in [0, 15] with an fp16 scale d
(and, for Q4_1, an fp16 minimum m): w = d * (q - 8) for Q4_0, w = d * q + m = d * (q - 8) +
(m + 8d) for Q4_1. Both are torch's int4 group form `(q - 8) * scale + zero` with groups of 32
along the input dimension, which `_weight_int4pack_mm_for_cpu` multiplies in bfloat16 (scales
and zeros rounded from the file's fp16 to bfloat16, within the accuracy BENCHMARKS.md states).
Q4_K's groups of 32 (a 6-bit scale and min under a super-block's fp16 pair) map onto the same
int4 form. Q8_0 (w = d * q, q int8, 32 per block) keeps its int8 values and scales for the
embedding lookup; as an LM head it is requantized to one scale per row for `_weight_int8pack_mm`.
Other types are dequantized to a dense dtype at load (said in the log).
"""

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32  # weights per GGUF block, and per int4 group here
Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES = 18, 20, 34  # bytes per block of 32 weights
Q4_K_BYTES = 144  # bytes per super-block of 256 weights (8 groups of 32)


@dataclass
class QuantizedWeight:
    """An [N, K] weight as per-group integers: w[n, k] = scale[n, g] * (q[n, k] - offset) +
    zero[n, g] with g = k // 32 (offset 8 for 4-bit values stored 0..15, 0 for int8)."""

    kind: str  # "q4" (q uint8 in [0, 15]) | "q8" (q int8)
    q: torch.Tensor  # [N, K]
    scale: torch.Tensor  # [N, K // 32] float32
    zero: torch.Tensor | None  # [N, K // 32] float32 ("q4"), None ("q8")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the file means."""
        n, k = self.q.shape
        q = self.q.float().view(n, k // GROUP, GROUP)
        if self.kind == "q4":
            w = (q - 8) * self.scale[..., None] + self.zero[..., None]
        else:
            w = q * self.scale[..., None]
        return w.view(n, k)

    def rows(self, index: torch.Tensor | slice) -> "QuantizedWeight":
        zero = None if self.zero is None else self.zero[index]
        return QuantizedWeight(self.kind, self.q[index], self.scale[index], zero)

    def cols(self, start: int, length: int) -> "QuantizedWeight":
        """Input columns [start, start + length), both multiples of the group of 32."""
        g = slice(start // GROUP, (start + length) // GROUP)
        zero = None if self.zero is None else self.zero[:, g].contiguous()
        return QuantizedWeight(self.kind, self.q[:, start : start + length].contiguous(),
                               self.scale[:, g].contiguous(), zero)


def from_gguf_blocks(raw: np.ndarray, qtype_name: str) -> QuantizedWeight | None:
    """The QuantizedWeight of a GGUF tensor's raw block rows ([N, K / 32 * block bytes],
    uint8), or None for a type kept in no quantized form here."""
    n = raw.shape[0]
    if qtype_name == "Q8_0":
        blocks = raw.reshape(n, -1, Q8_0_BYTES)
        scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = blocks[..., 2:].copy().view(np.int8).reshape(n, -1)
        return QuantizedWeight("q8", torch.from_numpy(q), torch.from_numpy(scale), None)
    if qtype_name == "Q4_K":
        return _q4_k(raw)
    if qtype_name not in ("Q4_0", "Q4_1"):
        return None
    size = Q4_0_BYTES if qtype_name == "Q4_0" else Q4_1_BYTES
    blocks = raw.reshape(n, -1, size)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    packed = blocks[..., size - 16 :]  # weight j in the low nibble of byte j, j + 16 in the high
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)
    return QuantizedWeight("q4", torch.from_numpy(q), torch.from_numpy(d),
                           torch.from_numpy(zero))


def _q4_k(raw: np.ndarray) -> QuantizedWeight:
    """Q4_K: super-blocks of 256 weights, an fp16 scale d and min dmin, and for each of the 8
    groups of 32 a 6-bit scale s and min m: w = d*s*q - dmin*m, i.e. the int4 form with
    scale d*s and zero 8*d*s - dmin*m (one more float32 rounding than llama.cpp's)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, Q4_K_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    # 12 bytes hold 8 six-bit scales and 8 six-bit mins: bytes 0-3 scales 0-3 (low 6 bits)
    # and the high 2 bits of scales 4-7; bytes 4-7 the same for the mins; bytes 8-11 the low
    # 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)
    a, b, c = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    scale = d[..., None] * sc.astype(np.float32)  # [N, blocks, 8]
    zero = 8 * scale - dmin[..., None] * mn.astype(np.float32)
    # 4 runs of 32 bytes: low nibbles are group 2j, high nibbles group 2j + 1
    qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1)
    return QuantizedWeight("q4", torch.from_numpy(q), torch.from_numpy(scale.reshape(n, -1)),
                           torch.from_numpy(zero.reshape(n, -1)))


def pack_int4(parts: list[QuantizedWeight]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 4-bit parts along N into `_weight_int4pack_mm_for_cpu`'s operands: the packed
    weight and the [K / 32, N, 2] bfloat16 scales-and-zeros."""
    q = torch.cat([p.q for p in parts]).to(torch.int32)
    scale = torch.cat([p.scale for p in parts])
    zero = torch.cat([p.zero for p in parts])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_zeros


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor
                ) -> torch.Tensor:
    """x W^T for x [T, K] (the model's activations are 2-D) and a packed 4-bit W, computed in
    bfloat16 (the kernel's fast path), returned in x's dtype."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), packed, GROUP, scales_zeros)
    return y.to(x.dtype)


def int8_rows(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 weight requantized to int8 with one scale per row (`_weight_int8pack_mm`'s
    form): the row's largest magnitude maps to 127."""
    n = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.bfloat16)
    for start in range(0, n, 4096):  # a slice at a time: no float32 copy of the whole table
        w = weight.rows(slice(start, start + 4096)).dequantize()
        # the kernel takes bfloat16 scales: round each up (by at most 2^-8) before
        # quantizing, so every weight is within half a step of its int8 value, none past 127
        s = (w.abs().amax(dim=1).clamp(min=1e-12) / 127 * (1 + 2**-8)).to(torch.bfloat16)
        q[start : start + 4096] = torch.round(w / s.float()[:, None]).clamp(-127, 127)
        scale[start : start + 4096] = s
    return q, scale


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x W^T for x [T, K] and an int8 W with a scale per row (`int8_rows`), in bfloat16."""
    return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, scales).to(x.dtype)


def read_part(loaded, dim: int | None = None, start: int = 0, length: int | None = None):
    """A checkpoint tensor, or the slice [start, start + length) of it along `dim`: a
    torch.Tensor, a QuantizedWeight, or a lazy checkpoint tensor (anything with
    `read(dim, start, length)`, which reads only that slice from the file). A quantized slice
    along the input dimension that does not fall on its groups of 32 comes dense."""
    if hasattr(loaded, "read"):
        return loaded.read(dim, start, length)
    if dim is None or (start == 0 and length == loaded.shape[dim]):
        return loaded
    if isinstance(loaded, QuantizedWeight):
        if dim == 0:
            return loaded.rows(slice(start, start + length))
        if start % GROUP == 0 and length % GROUP == 0:
            return loaded.cols(start, length)
        loaded = loaded.dequantize()
    return loaded.narrow(dim, start, length)
