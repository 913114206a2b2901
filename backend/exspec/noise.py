"""Counter-based Gumbel noise: g(seed, position, token), computed on the device.

The coupled sampler (sampler.py) draws every token as argmax(log p + g) with the noise of its
request's seed and the token's absolute position. The noise is a pure function of those three
integers, so it does not depend on k, the batch, the schedule or which model asks: the draft and
the target see the same noise, and a request samples the same tokens wherever it runs.

The hash is two rounds of MurmurHash3's 32-bit finaliser (fmix32), keyed by (seed, position),
held in int64 tensors with every product kept below 2^63 (no reliance on overflow), so CPU and
GPU give the same bits and a captured graph can include it.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# Distinct odd constants so that seed 0 at position 0 is not a fixed point of the mixer.
SEED_SALT, POSITION_SALT, SECOND_KEY_SALT = 0x9E3779B9, 0x85EBCA77, 0xC2B2AE3D
UNIFORM_BITS = 23   # (n + 0.5) / 2^23 is exact in float32 and never 0 or 1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), in two 16-bit halves of c (no int64 overflow)."""
    low, high = c & 0xFFFF, c >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 fmix32: a bijection of [0, 2^32) with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """seeds [B] (int64 >= 0), positions [B, T] -> [B, T, vocab] float32 uniforms in (0, 1)."""
    seed = mix32((seeds & MASK32) ^ mix32(((seeds >> 32) & MASK32) ^ SEED_SALT))
    key_a = mix32(seed[:, None] ^ mix32((positions & MASK32) ^ POSITION_SALT))   # [B, T]
    key_b = mix32(key_a ^ SECOND_KEY_SALT)
    token = torch.arange(vocab, device=positions.device, dtype=torch.long)
    bits = mix32(mix32(token ^ key_a[..., None]) ^ key_b[..., None])             # [B, T, V]
    return ((bits >> (32 - UNIFORM_BITS)).float() + 0.5) * (0.5 ** UNIFORM_BITS)


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, T, vocab] standard Gumbel noise -log(-log(u)), finite everywhere."""
    return -torch.log(-torch.log(uniforms(seeds, positions, vocab)))
