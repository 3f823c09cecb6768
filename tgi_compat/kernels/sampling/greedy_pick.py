"""The all-greedy step's choice (tgi_compat.router.sampling.Sampler): each row's argmax and its log-probability.

torch spells it argmax + gather + logsumexp, six kernels that read the [B, V] logits five times (0.114 ms a step
at 64 rows of Llama-3's 128,256 ids on an H200, 2% of the step). Here the logits are read once: every program
reduces a chunk of a row to (max, first index of the max, sum of exp(x - max)), and one program a row merges its
chunks. The chosen id is the row's first maximum, as torch.argmax's; its logprob is x[id] - logsumexp(x) =
-log(sum exp(x - max)). The second kernel also writes ids and logprobs as the float64 [2, B] block that the
step's one device-to-host copy takes (tgi_compat.router.sampling.SamplerOutput.start_copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# a step's row count: one compiled kernel for every batch size (specialised on 1 or a multiple of 16, a batch of a
# new kind compiled in the middle of serving: 0.26-1 s that every stream waited)
STEP_SIZES = ["num_rows"]
CHUNK = 2048  # logits a program reduces: 16 a thread at 4 warps; 63 programs a row of a 128k vocabulary


@triton.jit(do_not_specialize=STEP_SIZES)
def _chunk_kernel(
    logits_ptr,  # [B, V] float32 / bfloat16 / float16, unit column stride
    partial_ptr,  # [3, B, C] float32: max, first index of the max, sum of exp(x - max)
    stride_b,
    vocab,
    num_rows,
    num_chunks,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_b + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    top, first = first_max(x, cols, vocab)
    total = sum_exp(x, top)
    at = row * num_chunks + chunk
    plane = num_rows * num_chunks
    tl.store(partial_ptr + at, top)
    tl.store(partial_ptr + plane + at, first.to(tl.float32))  # exact: ids < 2^24
    tl.store(partial_ptr + 2 * plane + at, total)


@triton.jit
def first_max(x, ids, missing):
    """(max of x, the first of `ids` where x holds it): `missing` where nothing equals the max (NaN). Over the parts
    of a row in id order, each with its own first index, the smallest among those holding the max is the row's."""
    top = tl.max(x, 0)
    return top, tl.min(tl.where(x == top, ids, missing), 0)


@triton.jit
def sum_exp(x, top):
    """sum of exp(x - top), top = max(x): all -inf adds 0, not NaN."""
    return tl.sum(tl.exp(x - tl.where(top == float("-inf"), 0.0, top)), 0)


@triton.jit
def merged_sum_exp(tops, totals, top):
    """Parts' sums of exp(x - their max) -> the row's sum of exp(x - top), top = max(tops)."""
    return tl.sum(totals * tl.exp(tops - tl.where(top == float("-inf"), 0.0, top)), 0)


@triton.jit
def _merge_parts(tops, firsts, totals, vocab):
    """Parts of a row in id order, each (max, first index of the max, sum of exp(x - max)) -> the row's: the first
    index is `vocab` where no part's maximum compares (NaN)."""
    top, chosen = first_max(tops, firsts, vocab)
    return top, chosen.to(tl.int64), merged_sum_exp(tops, totals, top)


@triton.jit
def _load_chunks(partial_ptr, row, vocab, num_rows, num_chunks, CHUNKS: tl.constexpr):
    offs = tl.arange(0, CHUNKS)
    mask = offs < num_chunks
    at = row * num_chunks + offs
    plane = num_rows * num_chunks
    tops = tl.load(partial_ptr + at, mask=mask, other=float("-inf"))
    firsts = tl.load(partial_ptr + plane + at, mask=mask, other=vocab)
    totals = tl.load(partial_ptr + 2 * plane + at, mask=mask, other=0.0)
    return tops, firsts, totals


@triton.jit
def _store_choice(ids_ptr, packed_ptr, row, num_rows, chosen, total, vocab):
    chosen = tl.minimum(chosen, vocab - 1)  # a row with no comparable maximum (NaN) still names a real id
    tl.store(ids_ptr + row, chosen)
    tl.store(packed_ptr + row, chosen.to(tl.float64))
    tl.store(packed_ptr + num_rows + row, (-tl.log(total)).to(tl.float64))


@triton.jit(do_not_specialize=STEP_SIZES)
def _merge_kernel(
    partial_ptr,
    ids_ptr,  # [B] int64
    packed_ptr,  # [2, B] float64: ids, then logprobs
    vocab,
    num_rows,
    num_chunks,
    CHUNKS: tl.constexpr,  # num_chunks padded to a power of two
):
    row = tl.program_id(0)
    tops, firsts, totals = _load_chunks(partial_ptr, row, vocab, num_rows, num_chunks, CHUNKS)
    _, chosen, total = _merge_parts(tops, firsts, totals, vocab)
    _store_choice(ids_ptr, packed_ptr, row, num_rows, chosen, total, vocab)


# A vocabulary block's partial of a row travels as the 12 bytes of its three float32 values, one bf16 integer
# (0..255, exact) a byte: the 16-bit gather of tgi_compat.kernels.comm.one_shot_all_reduce then carries it (no value it sends may
# be -0.0, its sentinel), where float32 would need NCCL.
PARTIAL_BYTES = 12


@triton.jit(do_not_specialize=STEP_SIZES)
def _block_merge_kernel(
    partial_ptr,
    out_ptr,  # [B, PARTIAL_BYTES] bf16 out: the bytes of (max, first id of the max as float32, sum of exp(x - max))
    block_vocab,  # ids in this block
    id_offset,  # the whole vocabulary's id of the block's first
    vocab,  # the whole vocabulary's size: the first id where none compares
    num_rows,
    num_chunks,
    CHUNKS: tl.constexpr,
    PARTIAL: tl.constexpr,  # PARTIAL_BYTES
):
    row = tl.program_id(0)
    tops, firsts, totals = _load_chunks(partial_ptr, row, block_vocab, num_rows, num_chunks, CHUNKS)
    top, chosen, total = _merge_parts(tops, firsts, totals, block_vocab)
    first = tl.where(chosen < block_vocab, chosen + id_offset, vocab).to(tl.float32)  # exact: ids < 2^24
    offs = tl.arange(0, 16)
    field, byte = offs // 4, offs % 4
    bits = tl.where(
        field == 0,
        top.to(tl.int32, bitcast=True),
        tl.where(field == 1, first.to(tl.int32, bitcast=True), total.to(tl.int32, bitcast=True)),
    )
    value = (bits >> (8 * byte)) & 255
    tl.store(out_ptr + row * PARTIAL + offs, value.to(tl.float32).to(out_ptr.dtype.element_ty), mask=offs < PARTIAL)


@triton.jit
def _load_field(parts_ptr, row_start, blocks, mask, field: tl.constexpr, PARTIAL: tl.constexpr):
    """Field `field` of every block's partial: its 4 bytes (bf16 integers) back into float32 [BLOCKS]."""
    byte = tl.arange(0, 4)
    raw = tl.load(
        parts_ptr + row_start + blocks[:, None] * PARTIAL + field * 4 + byte[None, :], mask=mask[:, None], other=0.0
    )
    bits = tl.sum(raw.to(tl.float32).to(tl.int32) << (8 * byte[None, :]), 1)  # disjoint bytes: the sum is the OR
    return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=STEP_SIZES)
def _blocks_merge_kernel(
    parts_ptr,  # [B, blocks * PARTIAL_BYTES] bf16: every block's bytes, in id order
    ids_ptr,
    packed_ptr,
    vocab,
    num_rows,
    num_blocks,
    BLOCKS: tl.constexpr,  # num_blocks padded to a power of two
    PARTIAL: tl.constexpr,  # PARTIAL_BYTES
):
    row = tl.program_id(0)
    blocks = tl.arange(0, BLOCKS)
    mask = blocks < num_blocks
    row_start = row.to(tl.int64) * num_blocks * PARTIAL
    tops = tl.where(mask, _load_field(parts_ptr, row_start, blocks, mask, 0, PARTIAL), float("-inf"))
    firsts = tl.where(mask, _load_field(parts_ptr, row_start, blocks, mask, 1, PARTIAL), vocab)
    totals = tl.where(mask, _load_field(parts_ptr, row_start, blocks, mask, 2, PARTIAL), 0.0)
    _, chosen, total = _merge_parts(tops, firsts, totals, vocab)
    _store_choice(ids_ptr, packed_ptr, row, num_rows, chosen, total, vocab)


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (ids [B] int64, [2, B] float64 holding the ids and their logprobs)."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, CHUNK)
    partial = torch.empty(3, num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    packed = torch.empty(2, num_rows, dtype=torch.float64, device=logits.device)
    if num_rows == 0:
        return ids, packed
    _chunk_kernel[(num_rows, num_chunks)](
        logits, partial, logits.stride(0), vocab, num_rows, num_chunks, CHUNK=CHUNK, num_warps=4
    )
    _merge_kernel[(num_rows,)](
        partial, ids, packed, vocab, num_rows, num_chunks, CHUNKS=triton.next_power_of_2(num_chunks), num_warps=1
    )
    return ids, packed


def greedy_pick_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What tgi_compat.router.sampling.sampler computes for an all-greedy batch without the kernel."""
    scores = logits.float()
    ids = scores.argmax(dim=-1)
    logprobs = scores.gather(1, ids[:, None]).squeeze(1) - torch.logsumexp(scores, dim=-1)
    return ids, torch.stack([ids.to(torch.float64), logprobs.to(torch.float64)])


def greedy_block_partials(logits: torch.Tensor, id_offset: int, vocab: int) -> torch.Tensor:
    """A vocabulary block's part of the greedy choice (vocab-parallel logits): logits [B, V_block] of the ids
    id_offset ... id_offset + V_block - 1 -> [B, PARTIAL_BYTES] bf16, the bytes of (max, first id of the max, sum of
    exp(x - max)). The blocks' partials side by side in id order are what `greedy_merge_blocks` takes."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_rows, block_vocab = logits.shape
    num_chunks = max(1, triton.cdiv(block_vocab, CHUNK))
    partial = torch.empty(3, num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    out = torch.empty(num_rows, PARTIAL_BYTES, dtype=torch.bfloat16, device=logits.device)
    if num_rows == 0:
        return out
    _chunk_kernel[(num_rows, num_chunks)](
        logits, partial, logits.stride(0), block_vocab, num_rows, num_chunks, CHUNK=CHUNK, num_warps=4
    )
    _block_merge_kernel[(num_rows,)](
        partial,
        out,
        block_vocab,
        id_offset,
        vocab,
        num_rows,
        num_chunks,
        CHUNKS=triton.next_power_of_2(num_chunks),
        PARTIAL=PARTIAL_BYTES,
        num_warps=1,
    )
    return out


def greedy_merge_blocks(parts: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, blocks * PARTIAL_BYTES] bf16, every vocabulary block's `greedy_block_partials` in id order -> what
    `greedy_pick` returns for the whole logits."""
    num_rows, width = parts.shape
    num_blocks = width // PARTIAL_BYTES
    ids = torch.empty(num_rows, dtype=torch.int64, device=parts.device)
    packed = torch.empty(2, num_rows, dtype=torch.float64, device=parts.device)
    if num_rows == 0:
        return ids, packed
    _blocks_merge_kernel[(num_rows,)](
        parts.contiguous(),
        ids,
        packed,
        vocab,
        num_rows,
        num_blocks,
        BLOCKS=triton.next_power_of_2(num_blocks),
        PARTIAL=PARTIAL_BYTES,
        num_warps=1,
    )
    return ids, packed


def greedy_block_partials_ref(logits: torch.Tensor, id_offset: int, vocab: int) -> torch.Tensor:
    scores = logits.float()
    num_rows = scores.shape[0]
    if scores.shape[1] == 0:  # a block past the vocabulary's end: nothing to choose
        top = torch.full((num_rows,), float("-inf"), device=scores.device)
        first, total = torch.full_like(top, vocab), torch.zeros_like(top)
    else:
        top = scores.max(dim=-1).values
        ids = torch.arange(scores.shape[1], device=scores.device) + id_offset
        first = torch.where(scores == top[:, None], ids, vocab).min(dim=-1).values.float()
        shift = torch.where(top == float("-inf"), 0.0, top)
        total = torch.exp(scores - shift[:, None]).sum(dim=-1)
    values = torch.stack([top, first, total], dim=1).contiguous()  # [B, 3] float32
    return values.view(torch.uint8).to(torch.bfloat16)  # [B, 12]: little-endian bytes, as the kernel writes them


def greedy_merge_blocks_ref(parts: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows = parts.shape[0]
    values = parts.to(torch.uint8).view(torch.float32).view(num_rows, -1, 3)  # [B, blocks, 3]
    tops, firsts, totals = values.unbind(-1)
    top = tops.max(dim=-1).values
    ids = torch.where(tops == top[:, None], firsts, float(vocab)).min(dim=-1).values.long().clamp(max=vocab - 1)
    shift = torch.where(top == float("-inf"), 0.0, top)
    logprobs = -torch.log((totals * torch.exp(tops - shift[:, None])).sum(dim=-1))
    return ids, torch.stack([ids.to(torch.float64), logprobs.to(torch.float64)])
