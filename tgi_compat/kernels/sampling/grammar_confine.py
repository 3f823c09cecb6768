"""Grammar confinement of sampled scores in one pass per constrained row (tgi_compat.router.sampling.grammar.GrammarMask.confine).

After every warper, on the rows a grammar constrains: NaN counts as -inf, +inf as the largest float, and a
row left without a finite score gets 0 on the lowest token id its bitmask allows, so whatever extreme
parameters did to the scores, the choice stays inside the grammar. The torch version took ~20 launches
(1 ms of host time at 64 rows on an H100); this is one, and it writes only the scores it changes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)  # a global a kernel reads must be a constexpr


@triton.jit
def _confine_kernel(
    scores_ptr,  # [B, V] float32, changed in place
    bitmask_ptr,  # [R, W] int32, row r for scores row row_index[r]; bit j of word i allows token 32 * i + j
    row_index_ptr,  # [R] int32: the constrained rows (unused when HAS_INDEX is False: R == B)
    stride_s,
    stride_b,
    vocab,
    num_words,
    HAS_INDEX: tl.constexpr,
    BLOCK: tl.constexpr,
    WORD_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = tl.load(row_index_ptr + pid).to(tl.int64) if HAS_INDEX else pid
    row_scores = scores_ptr + row * stride_s
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        s = tl.load(row_scores + offs, mask=mask, other=float("-inf"))
        nan, posinf = s != s, s == float("inf")
        s = tl.where(nan, float("-inf"), tl.where(posinf, FLOAT32_MAX, s))
        tl.store(row_scores + offs, s, mask=mask & (nan | posinf))  # usually nothing: a read-only pass
        best = tl.maximum(best, s)
    if tl.max(best, 0) == float("-inf"):  # nothing allowed kept a score: the lowest allowed id gets 0
        lowest = tl.full([WORD_BLOCK], 2**62, tl.int64)
        for start in range(0, num_words, WORD_BLOCK):
            offs = start + tl.arange(0, WORD_BLOCK)
            word = tl.load(bitmask_ptr + pid * stride_b + offs, mask=offs < num_words, other=0)
            bits = word.to(tl.int64) & 0xFFFFFFFF
            low_bit = bits & -bits  # the word's lowest set bit: 2**k, exact in float32, whose exponent is k
            bit_index = ((low_bit.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127).to(tl.int64)
            lowest = tl.minimum(lowest, tl.where(bits != 0, 32 * offs.to(tl.int64) + bit_index, 2**62))
        token = tl.min(lowest, 0)
        tl.store(row_scores + token, 0.0, mask=token < vocab)


def grammar_confine(scores: torch.Tensor, bitmask: torch.Tensor, row_index: torch.Tensor | None) -> torch.Tensor:
    """In place on a float32 [B, V] with unit stride; row_index: int32 [R], the scores row of each bitmask
    row (None: bitmask row r is scores row r)."""
    assert scores.dtype == torch.float32 and scores.stride(1) == 1 and bitmask.dtype == torch.int32
    if bitmask.shape[0]:
        _confine_kernel[(bitmask.shape[0],)](
            scores,
            bitmask,
            scores if row_index is None else row_index,
            scores.stride(0),
            bitmask.stride(0),
            scores.shape[1],
            bitmask.shape[1],
            HAS_INDEX=row_index is not None,
            BLOCK=4096,
            WORD_BLOCK=1024,
            num_warps=8,
        )
    return scores


def grammar_confine_ref(scores: torch.Tensor, bitmask: torch.Tensor, row_index: torch.Tensor | None) -> torch.Tensor:
    """The same in torch ops (the CPU path)."""
    index = None if row_index is None else row_index.long()
    rows = scores if index is None else scores.index_select(0, index)
    rows.nan_to_num_(nan=float("-inf"), posinf=torch.finfo(rows.dtype).max, neginf=float("-inf"))
    stuck = rows.amax(dim=-1, keepdim=True) == float("-inf")
    first_word = (bitmask != 0).to(torch.uint8).argmax(dim=1)  # argmax: the first of equal maxima
    word = bitmask.gather(1, first_word[:, None]).to(torch.int64) & 0xFFFFFFFF  # [R, 1], unsigned
    powers = 2 ** torch.arange(32, dtype=torch.int64, device=bitmask.device)  # made there: no copy, no sync
    lowest_bit = ((word & -word) == powers).to(torch.uint8).argmax(dim=1)  # word & -word: its lowest set bit
    lowest = (32 * first_word + lowest_bit)[:, None]
    rows.scatter_(1, lowest, torch.where(stuck, 0.0, rows.gather(1, lowest)))
    return rows if index is None else scores.index_copy_(0, index, rows)
