"""The vocab-parallel embedding's lookup in one kernel (tgi_compat.modeling.layers.embedding.VocabEmbedding, sharded).

Each rank holds a block of the vocabulary's rows; a token's row comes from the rank whose block holds its id and
every other rank contributes zeros, so that the sum over the ranks that follows has each row once. torch spells
the lookup as eight kernels (shift, two compares, and, not, masked fill, gather, multiply: ~13 us of a 64-row
decode step on an H200). With a PushTarget each program also sends its values to the other ranks' all-reduce
buffers as it stores them (tgi_compat.kernels.comm.one_shot_all_reduce.push_to_peers, as tgi_compat.kernels.gemv.gemv's `push`), and the sum
then only gathers (`finish_pushed_all_reduce`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.comm.one_shot_all_reduce import PushTarget, push_kernel_args, push_to_peers

BLOCK = 1024  # hidden features a program: 8 a thread at 4 warps (16-byte vectors of bf16)


@triton.jit
def _vocab_shard_embedding_kernel(
    ids_ptr,  # [T] int64: token ids of the whole vocabulary
    weight_ptr,  # [rows, hidden]: this rank's block of rows
    out_ptr,  # [T, hidden]
    start,  # the block's first id
    size,  # the block's real rows (the last rank's block may be padded past them)
    hidden,
    stride_w,
    push_buffer_ptrs,  # PUSH: the PushTarget's buffers and halves (else any tensor)
    push_halves_ptr,
    push_capacity,
    BLOCK: tl.constexpr,
    PUSH: tl.constexpr,
    PUSH_RANK: tl.constexpr,
    PUSH_WORLD: tl.constexpr,
    PUSH_BLOCK: tl.constexpr,  # the all-reduce's elements a program
    SENTINEL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < hidden
    local = tl.load(ids_ptr + token) - start + tl.zeros([BLOCK], tl.int64)  # [BLOCK], all equal: masks broadcast
    mine = (local >= 0) & (local < size)
    row = tl.where(mine, local, 0)
    values = tl.load(weight_ptr + row * stride_w + cols, mask=in_row & mine, other=0.0)
    flat = token * hidden + cols  # out is [T, hidden] contiguous: element (t, c) is the all-reduce's t * hidden + c
    tl.store(out_ptr + flat, values, mask=in_row)
    if PUSH:
        target = (push_buffer_ptrs, push_halves_ptr, push_capacity)
        push_to_peers(values, flat, in_row, target, PUSH_RANK, PUSH_WORLD, PUSH_BLOCK, SENTINEL)


def vocab_shard_embedding(
    ids: torch.Tensor, weight: torch.Tensor, start: int, size: int, push: PushTarget | None = None
) -> torch.Tensor:
    """[T] ids -> [T, hidden]: weight[id - start] where start <= id < start + size, else zeros. With `push`, the
    caller finishes the sum over the ranks with the all-reduce's `sent=True`."""
    assert weight.stride(1) == 1 and ids.dim() == 1, (weight.stride(), ids.shape)
    num_tokens, hidden = ids.shape[0], weight.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=weight.dtype, device=weight.device)
    if num_tokens == 0:
        return out
    grid = (num_tokens, triton.cdiv(hidden, BLOCK))
    push_args = push_kernel_args(push, ids)
    _vocab_shard_embedding_kernel[grid](
        ids, weight, out, start, size, hidden, weight.stride(0), BLOCK=BLOCK, num_warps=4, **push_args
    )
    return out


def vocab_shard_embedding_ref(ids: torch.Tensor, weight: torch.Tensor, start: int, size: int) -> torch.Tensor:
    local = ids - start
    mine = (local >= 0) & (local < size)
    return torch.nn.functional.embedding(local.masked_fill(~mine, 0), weight) * mine.unsqueeze(1)
