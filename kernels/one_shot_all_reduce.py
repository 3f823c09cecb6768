"""One-shot all-reduce over peer GPU memory with a single cross-GPU handshake per sum.

A decode step at --num-shard N makes two small sums a layer (8 KiB per row of Llama hidden state), so their
latency, not bandwidth, is the cost. torch's `one_shot_all_reduce` handshakes with every peer twice per sum:
once before reading the peers' copies (they are written) and once after (they may be overwritten). Here the
second handshake is not needed, because the copies alternate between two halves of the buffer:

    program b of sum e (e counts program b's sums on this rank; every rank makes the same sums in the same
    order, so e agrees across ranks) writes its slice of x into half e % 2 of this rank's buffer, then sets
    flag [e % 2, b, this rank] on every rank to e (release), then waits until flag [e % 2, b, p] on this rank
    is e for every rank p (acquire), then adds the ranks' slices in rank order.

Half e % 2 is next written by sum e + 2, which program b starts only after every rank's program b signalled
sum e + 1, i.e. after it finished reading sum e. The flags of the two halves are apart, so a fast rank's
signal for e + 1 never overwrites the one for e before it is seen. The sum is fp32 in rank order on every
rank, so every rank holds the same bits. No NVLink multicast, only peer loads, stores and atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, use_pdl

SUMS_MODULUS_MASK = (1 << 30) - 1  # each program's sum counter wraps to 0 after 2^30 - 1
BLOCK = 2048  # elements a program: 4 KiB of bf16, 16 a thread at 4 warps
MAX_PROGRAMS = 256  # 1 MiB of bf16 (the largest sum it takes) in programs of BLOCK elements


@triton.jit(do_not_specialize=["numel", "capacity"])  # one compiled kernel for every size
def _one_shot_all_reduce_kernel(
    x_ptr,
    out_ptr,
    numel,
    buffer_ptrs,  # int64 [WORLD]: each rank's buffer, two halves of `capacity` elements of x's dtype
    flag_ptrs,  # int64 [WORLD]: each rank's flags, int32 [2, MAX_PROGRAMS, WORLD]
    sums_made_ptr,  # int32 [MAX_PROGRAMS] on this rank: sums each program has made
    capacity,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    WORLD_POW2: tl.constexpr,
    MAX_PROGRAMS: tl.constexpr,
    BLOCK: tl.constexpr,
    SUMS_MODULUS_MASK: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent (kernels/pdl.py)
):
    pid = tl.program_id(0)
    if USE_PDL:
        # x is the previous kernel's output. The next kernel may launch at once: it streams its first weights
        # while this one waits for the peers, and it reads nothing of this one's before its own gdc_wait()
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # counted modulo 2^30 (an even modulus keeps the halves alternating): an int32 that ran on would turn
    # negative after ~37 hours of 2-rank decoding, and a negative half would address memory before the buffer
    epoch = (tl.load(sums_made_ptr + pid) + 1) & SUMS_MODULUS_MASK
    half = epoch & 1
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask)
    dtype = x_ptr.dtype.element_ty
    mine = tl.load(buffer_ptrs + RANK).to(tl.pointer_type(dtype))
    tl.store(mine + half * capacity + offs, x, mask=mask)
    tl.debug_barrier()  # the whole program's slice is written before the release below publishes it
    flag_row = (half * MAX_PROGRAMS + pid) * WORLD
    # every peer signalled, and waited for, by its own lane: the cross-GPU round trips overlap
    peers = tl.arange(0, WORLD_POW2)
    live = peers < WORLD
    peer_flags = tl.load(flag_ptrs + peers, mask=live, other=0).to(tl.pointer_type(tl.int32))
    epochs = tl.full([WORLD_POW2], 0, tl.int32) + epoch
    tl.atomic_xchg(peer_flags + flag_row + RANK, epochs, mask=live, sem="release", scope="sys")
    my_flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    arrived = tl.sum((~live).to(tl.int32))
    while arrived < WORLD_POW2:
        seen = tl.atomic_add(my_flags + flag_row + peers, 0 * epochs, mask=live, sem="acquire", scope="sys")
        arrived = tl.sum(((seen == epoch) | ~live).to(tl.int32))
    tl.debug_barrier()  # every thread reads the peers' slices after the acquire
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for peer in tl.static_range(WORLD):
        if peer == RANK:
            total += x.to(tl.float32)
        else:
            theirs = tl.load(buffer_ptrs + peer).to(tl.pointer_type(dtype))
            total += tl.load(theirs + half * capacity + offs, mask=mask, cache_modifier=".cv").to(tl.float32)
    tl.store(out_ptr + offs, total.to(dtype), mask=mask)
    tl.store(sums_made_ptr + pid, epoch)


def one_shot_all_reduce_(
    x: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    flag_ptrs: torch.Tensor,
    sums_made: torch.Tensor,
    capacity: int,
    rank: int,
) -> torch.Tensor:
    """x (contiguous, at most MAX_PROGRAMS * BLOCK and `capacity` elements) summed over the ranks, in place.

    buffer_ptrs / flag_ptrs: int64 device addresses of every rank's buffer and (zeroed) flags, as symmetric
    memory maps them; sums_made: this rank's zeroed int32 [MAX_PROGRAMS]. Every rank calls it with the same
    numel in the same order."""
    numel = x.numel()
    assert x.is_contiguous() and numel <= min(capacity, MAX_PROGRAMS * BLOCK), numel
    world = buffer_ptrs.numel()
    pdl = use_pdl(x)
    _one_shot_all_reduce_kernel[(triton.cdiv(numel, BLOCK),)](
        x, x, numel, buffer_ptrs, flag_ptrs, sums_made, capacity, rank, world, triton.next_power_of_2(world),
        MAX_PROGRAMS, BLOCK, SUMS_MODULUS_MASK, pdl, num_warps=4, **launch_options(pdl),
    )  # fmt: skip
    return x


def all_reduce_ref(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The kernel's sum: fp32, in rank order, rounded once to the inputs' dtype."""
    total = torch.zeros(inputs[0].shape, dtype=torch.float32, device=inputs[0].device)
    for x in inputs:
        total += x.float()
    return total.to(inputs[0].dtype)
