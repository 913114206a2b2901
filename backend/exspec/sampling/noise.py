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
CPU_CHUNK = 1 << 17  # tokens hashed at once on a CPU: 1 MiB of int64, within a core's L2


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), in place, in two 16-bit halves of c (no int64
    overflow): x * low < 2^48, and the high half's product needs only x's low 16 bits."""
    low, high = c & 0xFFFF, c >> 16
    high_part = (x & 0xFFFF).mul_(high << 16)
    return x.mul_(low).add_(high_part).bitwise_and_(MASK32)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 fmix32: a bijection of [0, 2^32) with full avalanche. Works in place on x."""
    x.bitwise_xor_(x >> 16)
    _mul32(x, 0x85EBCA6B)
    x.bitwise_xor_(x >> 13)
    _mul32(x, 0xC2B2AE35)
    return x.bitwise_xor_(x >> 16)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """seeds [B] (int64 >= 0), positions [B, T] -> [B, T, vocab] float32 uniforms in (0, 1)."""
    return _noise(seeds, positions, vocab, gumbel=False)


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, T, vocab] standard Gumbel noise -log(-log(u)), finite everywhere."""
    return _noise(seeds, positions, vocab, gumbel=True)


def _noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int, gumbel: bool) -> torch.Tensor:
    """The noise of every (row, position) key, a few keys' vocabularies at a time on a CPU:
    the hash is ~20 passes over int64 tokens, and a chunk that stays in the CPU's cache makes
    them cache traffic instead of memory traffic (at B = 64, k = 5, V = 152k the whole block is
    470 MB a pass). A GPU takes every key in one go (fewer kernel launches)."""
    seed = mix32((seeds & MASK32) ^ mix32(((seeds >> 32) & MASK32) ^ SEED_SALT))
    key_a = mix32(seed[:, None] ^ mix32((positions & MASK32) ^ POSITION_SALT))    # [B, T]
    key_b = mix32(key_a ^ SECOND_KEY_SALT)
    keys_a, keys_b = key_a.reshape(-1, 1), key_b.reshape(-1, 1)
    out = torch.empty(keys_a.shape[0], vocab, device=positions.device)
    token = torch.arange(vocab, device=positions.device, dtype=torch.long)
    step = keys_a.shape[0] if out.is_cuda else max(1, CPU_CHUNK // vocab)
    for start in range(0, keys_a.shape[0], step):
        rows = slice(start, start + step)
        bits = mix32(mix32(token ^ keys_a[rows]).bitwise_xor_(keys_b[rows]))
        u = out[rows].copy_(bits >> (32 - UNIFORM_BITS)).add_(0.5).mul_(0.5 ** UNIFORM_BITS)
        if gumbel:
            u.log_().neg_().log_().neg_()
    return out.view(*positions.shape, vocab)
