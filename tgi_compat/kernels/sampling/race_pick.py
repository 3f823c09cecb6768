"""A sampled step's choice without top-n (tgi_compat.router.sampling.Sampler): each sampling row's exponential race
argmax(x + Gumbel(seed, step, id)), each greedy row's argmax(x), and the chosen id's logprob x[id] - logsumexp(x),
from one read of the scores.

torch spells the race as the sampler's `gumbel_noise` over the whole batch: [B, V] int64 hashes through some twenty
elementwise passes, ~11 GB of memory traffic a step at 256 rows of Llama-3's 128,256 ids (a count of the passes,
not a measurement), then log_softmax, argmax and gather. Here every program hashes its chunk of a row in registers
(the same 32-bit hash, on uint32: its products wrap as the sampler's masked int64 ones do) and reduces it as
greedy_pick.py does, with the race's maximum, its first index and x there beside the row's max and sum of exp; one
program a row merges the chunks. The race runs on x itself, not on log_softmax(x): the same argmax up to float32
rounding, so a seed's tokens on a GPU are this kernel's, alone or in any batch (the CPU keeps the sampler's torch
path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.sampling.greedy_pick import CHUNK, first_max, merged_sum_exp, sum_exp

LARGEST_BELOW_ONE = 1.0 - 2.0**-24  # the float32 just under 1: a uniform of 1.0 would give +inf noise
MASK32 = 0xFFFFFFFF
_BELOW_ONE = tl.constexpr(LARGEST_BELOW_ONE)  # (the kernels' copy)


def gumbel_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B] int64 seeds and generation steps -> [B] int64 hash keys (< 2**32): the noise of a row depends on these
    alone, so a seed's tokens never depend on the batch."""
    lo, hi = seeds & MASK32, (seeds >> 32) & MASK32
    return mix32(mix32(lo ^ mix32(hi)) ^ ((steps * 0x9E3779B1) & MASK32))


def gumbel_noise_of_keys(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """-log(-log U) with U from a 32-bit hash of (key, token id); [B] -> [B, V] float32 (the definition)."""
    token = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    bits = mix32(mix32((keys[:, None] + token * 0x2C1B3C6D) & MASK32) ^ keys[:, None])  # [B, V]
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # The top value (2**24 - 0.5) / 2**24 rounds to 1.0 in float32, whose noise is +inf: that token would
    # win whatever its score, and a masked one (-inf + inf = NaN) would win argmax too. Keep U below 1.
    uniform = uniform.clamp_(max=LARGEST_BELOW_ONE)
    return -torch.log(-torch.log(uniform))


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors; multipliers < 2**31 so products never overflow."""
    x = x ^ (x >> 16)
    x = (x * 0x5BD1E995) & MASK32
    x = x ^ (x >> 13)
    x = (x * 0x27D4EB2D) & MASK32
    return x ^ (x >> 16)


@triton.jit
def _mix32(x):
    """mix32 on uint32."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x5BD1E995, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.full(x.shape, 0x27D4EB2D, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _gumbel(key, cols):
    """-log(-log U) of ids `cols` under a row's `key` (uint32), U from the hash's top 24 bits: gumbel_noise's."""
    ids = cols.to(tl.uint32)
    bits = _mix32(_mix32(key + ids * tl.full(ids.shape, 0x2C1B3C6D, tl.uint32)) ^ key)
    uniform = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    uniform = tl.minimum(uniform, _BELOW_ONE)
    return -tl.log(-tl.log(uniform))


@triton.jit
def _race_chunk_kernel(
    scores_ptr,  # [B, V] float32, unit column stride
    keys_ptr,  # [B] int64: each row's hash key (< 2**32)
    sampling_ptr,  # [B] bool: the row races (else takes its argmax)
    partial_ptr,  # [5, B, C] float32: race max, its first index, x there; max of x, sum of exp(x - max)
    stride_b,
    vocab,
    num_rows,
    num_chunks,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(scores_ptr + row * stride_b + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    raced = x
    if tl.load(sampling_ptr + row) != 0:
        raced = x + _gumbel(tl.load(keys_ptr + row).to(tl.uint32), cols)
    race_top, race_first = first_max(raced, cols, vocab)
    race_x = tl.sum(tl.where(cols == race_first, x, 0.0), 0)
    top = tl.max(x, 0)
    total = sum_exp(x, top)
    at = row * num_chunks + chunk
    plane = num_rows * num_chunks
    tl.store(partial_ptr + at, race_top)
    tl.store(partial_ptr + plane + at, race_first.to(tl.float32))  # exact: ids < 2^24
    tl.store(partial_ptr + 2 * plane + at, race_x)
    tl.store(partial_ptr + 3 * plane + at, top)
    tl.store(partial_ptr + 4 * plane + at, total)


@triton.jit
def _race_merge_kernel(
    partial_ptr,
    ids_ptr,  # [B] int64
    packed_ptr,  # [2, B] float64: ids, then logprobs
    vocab,
    num_rows,
    num_chunks,
    CHUNKS: tl.constexpr,  # num_chunks padded to a power of two
):
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS)
    mask = offs < num_chunks
    at = row * num_chunks + offs
    plane = num_rows * num_chunks
    race_tops = tl.load(partial_ptr + at, mask=mask, other=float("-inf"))
    race_firsts = tl.load(partial_ptr + plane + at, mask=mask, other=vocab)
    race_xs = tl.load(partial_ptr + 2 * plane + at, mask=mask, other=0.0)
    tops = tl.load(partial_ptr + 3 * plane + at, mask=mask, other=float("-inf"))
    totals = tl.load(partial_ptr + 4 * plane + at, mask=mask, other=0.0)
    _, chosen = first_max(race_tops, race_firsts, vocab)
    chosen_x = tl.sum(tl.where(race_firsts == chosen, race_xs, 0.0), 0)
    top = tl.max(tops, 0)
    total = merged_sum_exp(tops, totals, top)
    chosen = tl.minimum(chosen.to(tl.int64), vocab - 1)  # a row with no comparable maximum (NaN) names a real id
    tl.store(ids_ptr + row, chosen)
    tl.store(packed_ptr + row, chosen.to(tl.float64))
    tl.store(packed_ptr + num_rows + row, (chosen_x - top - tl.log(total)).to(tl.float64))


def race_pick(scores: torch.Tensor, keys: torch.Tensor, is_sampling: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, V] float32, keys [B] int64 (gumbel_keys), is_sampling [B] bool
    -> (ids [B] int64, [2, B] float64 holding the ids and their logprobs)."""
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    num_rows, vocab = scores.shape
    num_chunks = triton.cdiv(vocab, CHUNK)
    partial = torch.empty(5, num_rows, num_chunks, dtype=torch.float32, device=scores.device)
    ids = torch.empty(num_rows, dtype=torch.int64, device=scores.device)
    packed = torch.empty(2, num_rows, dtype=torch.float64, device=scores.device)
    if num_rows == 0:
        return ids, packed
    _race_chunk_kernel[(num_rows, num_chunks)](
        scores, keys, is_sampling, partial, scores.stride(0), vocab, num_rows, num_chunks, CHUNK=CHUNK, num_warps=4
    )
    _race_merge_kernel[(num_rows,)](
        partial, ids, packed, vocab, num_rows, num_chunks, CHUNKS=triton.next_power_of_2(num_chunks), num_warps=1
    )
    return ids, packed


def race_pick_ref(
    scores: torch.Tensor, keys: torch.Tensor, is_sampling: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition in torch: the noise of the same keys on the sampling rows, argmax, and the chosen id's
    log_softmax."""
    scores = scores.float()
    noise = gumbel_noise_of_keys(keys, scores.shape[-1])
    raced = torch.where(is_sampling[:, None], scores + noise, scores)
    ids = raced.argmax(dim=-1)
    logprobs = scores.gather(1, ids[:, None]).squeeze(1) - torch.logsumexp(scores, dim=-1)
    return ids, torch.stack([ids.to(torch.float64), logprobs.to(torch.float64)])
