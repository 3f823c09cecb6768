"""Shared-prefix (cascade) decode attention: the n / best_of siblings of one prompt read its KV once per step.

Siblings that took one prompt from the prefix cache hold the same KV slots for its first P tokens, so today's
flash-decoding (decode.py) reads those P keys once per sibling. Here a step's rows come in groups:

    table [B, 1 + G_MAX] int64 or int32:
        column 0 of row b: the length P of the prefix row b shares with its group (the first P slots of every
            member's req_to_token row are the leader's), 0 for a row in no group
        columns 1.. of row g: the batch positions of group g's rows (the first leads), -1 padding; groups are
            numbered from 0 in a row, so the rows past the last group hold -1 only

(tgi_compat.modeling.forward_batch.PrefixGroups.) Its shape is fixed by the batch size, so a CUDA graph captured
once replays any grouping.

One launch, two kinds of program (a KV head each), the long ones first: the grid is one-dimensional, every prefix
program of every KV head numbered before any suffix program (blocks start in about the order of their index: on a
grid of (programs, KV heads) the last heads' prefix programs would start behind the first heads' suffix programs and
end the launch; the two orders are timed side by side by `queue.sh diverse-kernel-ab`):
- prefix: (split of [0, P), group slot s) takes the groups s, s + slots, ... and stacks each one's G_MAX rows x GQA
  query heads on the M side of one tl.dot (decode.py's `_attend_split`): each prefix KV block is read once for the
  group. Sized for full groups (`group_slots`, `choose_prefix_splits`); smaller groups only loop more.
- suffix: (row, split of [P, kv_len)): each row's own tokens (its whole context when it is in no group).
Both write flash-decoding partials (normalised output, log-sum-exp) into one scratch [B, H, S + PS, D]: suffix
splits at [0, S), prefix splits at [S, S + PS); decode_merge's stage 2 merges them. A split with no keys
stores lse = -inf (weight 0), so a row in no group has its prefix splits at -inf (the suffix's split 0 writes
them) and a row whose suffix is empty merges its prefix alone.

`group_suffix`: a group's prefix program also reads its members' own keys (split s of each member's suffix after
split s of the prefix, one loop over the blocks of both, each suffix block seen by its member's rows only), so the
suffix programs work only for rows in no group; they take their rows in turn (`suffix_programs` of them, not one per
row and split: a grouped row's turn is a table read). With one split each way every row's output comes from one
program: it is written final, with no partials and no stage 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgi_compat.kernels.attention.decode import decode_attention_ref, dot_precision
from tgi_compat.kernels.attention.decode_merge import RUNTIME_SPLIT_ARGS, launch_stage2, split_outputs
from tgi_compat.kernels.attention.shared_prefix_programs import prefix_program, suffix_work

# Scratch strides and split counts follow the batch size: runtime values, one compiled kernel (decode_merge.py).
_RUNTIME_ARGS = [*RUNTIME_SPLIT_ARGS, "num_prefix_splits", "num_rows", "prefix_slots", "suffix_programs"]


@triton.jit(do_not_specialize=_RUNTIME_ARGS, do_not_specialize_on_alignment=_RUNTIME_ARGS)
def _shared_prefix_kernel(
    q_ptr,  # [B, H, D] (rotated)
    k_cache_ptr,  # [S, KVH, D]
    v_cache_ptr,
    req_to_token_ptr,  # [R, L] int32
    req_rows_ptr,  # [B]
    kv_lens_ptr,  # [B]
    table_ptr,  # [B, 1 + G_MAX]
    mid_out_ptr,  # [B, H, splits, D] fp32
    mid_lse_ptr,  # [B, H, splits] fp32
    out_ptr,  # [B, H, D]: written here when FINAL
    scale,
    num_splits,  # of each row's suffix
    num_prefix_splits,
    num_rows,  # B
    prefix_slots,  # the prefix's group programs
    suffix_programs,  # the suffix's programs (each takes every suffix_programs-th (row, split))
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_rt,
    stride_gb,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    G_MAX: tl.constexpr,  # rows per group at most
    G_PAD: tl.constexpr,  # G_MAX rounded up to a power of two
    M_PAD: tl.constexpr,  # G_MAX * GROUP rounded up to a power of two, >= 16 (the M side of tl.dot)
    GROUP_PAD: tl.constexpr,  # GROUP, >= 16
    PREFIX_SPLITS_PAD: tl.constexpr,  # num_prefix_splits rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per iteration over a suffix
    PREFIX_BLOCK_N: tl.constexpr,  # over a prefix
    DOT_PRECISION: tl.constexpr,
    GROUP_SUFFIX: tl.constexpr,  # the group programs read their members' own keys too
    FINAL: tl.constexpr,  # GROUP_SUFFIX with one split each way: outputs, not partials
    SOFTCAP: tl.constexpr = 0.0,
):
    """Programs [0, prefix_slots x num_prefix_splits x KV heads) take prefixes, the rest suffixes: one launch, so the
    suffix programs fill the SMs that the prefix's leave at its tail. The KV head varies fastest."""
    program = tl.program_id(0)
    kv_head = program % KV_HEADS
    pid = program // KV_HEADS
    queries = (q_ptr, stride_qb, stride_qh, scale)
    cache = (k_cache_ptr, v_cache_ptr, stride_ks, stride_kh, stride_vs, stride_vh, kv_head)
    tables = (req_to_token_ptr, stride_rt, req_rows_ptr, table_ptr, stride_gb, kv_lens_ptr)
    partials = (mid_out_ptr, mid_lse_ptr, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh)
    output = (out_ptr, stride_ob, stride_oh)
    num_prefix_programs = prefix_slots * num_prefix_splits
    if pid < num_prefix_programs:
        split, slot = pid % num_prefix_splits, pid // num_prefix_splits
        prefix_program(
            split, slot, prefix_slots, num_rows, num_prefix_splits, num_splits, queries, cache, tables, partials,
            output, GROUP, G_MAX, G_PAD, M_PAD, HEAD_DIM, BLOCK_D, PREFIX_BLOCK_N, DOT_PRECISION, SOFTCAP,
            GROUP_SUFFIX, FINAL,
        )  # fmt: skip
    elif GROUP_SUFFIX:  # the (row, split)s pid - num_prefix_programs, + suffix_programs, ...
        for work in range(pid - num_prefix_programs, num_rows * num_splits, suffix_programs):
            suffix_work(
                work // num_splits, work % num_splits, num_splits, num_prefix_splits, queries, cache, tables,
                partials, output, GROUP, GROUP_PAD, PREFIX_SPLITS_PAD, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION,
                SOFTCAP, GROUP_SUFFIX, FINAL,
            )  # fmt: skip
    else:  # one (row, split) a program
        work = pid - num_prefix_programs
        suffix_work(
            work // num_splits, work % num_splits, num_splits, num_prefix_splits, queries, cache, tables, partials,
            output, GROUP, GROUP_PAD, PREFIX_SPLITS_PAD, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION, SOFTCAP,
            GROUP_SUFFIX, FINAL,
        )  # fmt: skip


# Prefix programs per SM: one wave of the 3 an SM holds at two stages of 64-key K and V tiles (64 KB of shared
# memory; at the backend's three, 76 KB, an H100 SM holds 2, and 3 of the group_suffix form's 70 KB), all as long,
# so they end together. 4 splits of 8 groups x 8 KV heads (256 programs, 132 SMs) read ~1 TB/s; many
# shorter splits add partials (M_PAD x D fp32 each) to write and merge. benchmarks/device/diverse.py sweeps it.
PREFIX_PROGRAMS_PER_SM = 3


def group_slots(batch_size: int, group_max: int) -> int:
    """The prefix's group programs: one per group of a batch of full groups (n = group_max siblings each)."""
    return max(1, -(-batch_size // group_max))


def choose_prefix_splits(
    batch_size: int, group_max: int, num_kv_heads: int, num_sms: int, max_prefix_len: int, block_n: int, max_splits: int
) -> int:
    """The splits of each group's prefix, from static maxima only (graph-safe): the nearest to PREFIX_PROGRAMS_PER_SM
    programs per SM over a batch of full groups, at most one split per key block of the longest prefix."""
    programs = group_slots(batch_size, group_max) * num_kv_heads
    splits = (PREFIX_PROGRAMS_PER_SM * num_sms + programs // 2) // programs
    return max(1, min(splits, -(-max_prefix_len // block_n), max_splits))


# Suffix programs per SM where the group programs read their members' own keys: the suffix's work is then the rows
# in no group, taken in turn, and a grouped row's turn is a table read.
SUFFIX_PROGRAMS_PER_SM = 8


def choose_suffix_programs(
    batch_size: int, num_splits: int, num_kv_heads: int, num_sms: int, group_suffix: bool
) -> int:
    """The suffix's programs (each KV head's): one per (row, split), or with `group_suffix` at most
    SUFFIX_PROGRAMS_PER_SM per SM over the KV heads."""
    work = batch_size * num_splits
    if not group_suffix:
        return work
    return max(1, min(work, -(-SUFFIX_PROGRAMS_PER_SM * num_sms // num_kv_heads)))


def shared_prefix_decode_attention(
    q: torch.Tensor,  # [B, H, D], rotated
    k_cache: torch.Tensor,  # [S, KVH, D]
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,  # [R, L] int32
    req_rows: torch.Tensor,  # [B]
    kv_lens: torch.Tensor,  # [B]
    table: torch.Tensor,  # [B, 1 + G_MAX] int64 or int32: see the module docstring
    scale: float,
    num_splits: int,  # of each row's suffix
    num_prefix_splits: int,  # of each group's prefix
    out: torch.Tensor | None = None,  # [B, H, D]
    mid_out: torch.Tensor | None = None,  # [>=B, H, >= num_splits + num_prefix_splits, D] fp32 scratch
    mid_lse: torch.Tensor | None = None,  # [>=B, H, >= num_splits + num_prefix_splits] fp32 scratch
    block_n: int = 64,
    prefix_block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    softcap: float | None = None,
    prefix_slots: int = 0,  # group programs (each takes every slots-th group); 0: group_slots()
    group_suffix: bool = False,  # the group programs read their members' own keys too (module docstring)
    suffix_programs: int = 0,  # 0: one per (row, split), or choose_suffix_programs' with group_suffix
) -> torch.Tensor:
    """Decode attention of B one-token rows where groups of rows share their first prefix_lens keys: the
    prefix is read once per group, each row's suffix once per row, and the two merged by log-sum-exp."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, group_max = k_cache.shape[1], table.shape[1] - 1
    assert num_heads % num_kv_heads == 0 and q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert table.dtype in (torch.int32, torch.int64) and table.stride(1) == 1 and table.shape[0] == batch
    assert num_splits >= 1 and num_prefix_splits >= 1
    group = num_heads // num_kv_heads
    total_splits = num_splits + num_prefix_splits
    out, mid_out, mid_lse = split_outputs(q, total_splits, out, mid_out, mid_lse)
    if batch == 0:
        return out
    # the meta-parameters both stages take alike
    meta = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION=dot_precision(q.dtype),
        SOFTCAP=float(softcap or 0.0),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    common = (*q.stride()[:2], *k_cache.stride()[:2], *v_cache.stride()[:2], req_to_token.stride(0))
    scratch = (*mid_out.stride()[:3], *mid_lse.stride()[:2])
    prefix_slots = prefix_slots or group_slots(batch, group_max)
    if not suffix_programs:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        suffix_programs = choose_suffix_programs(batch, num_splits, num_kv_heads, num_sms, group_suffix)
    final = group_suffix and num_splits == 1 and num_prefix_splits == 1
    programs = prefix_slots * num_prefix_splits + suffix_programs
    _shared_prefix_kernel[(programs * num_kv_heads,)](
        q, k_cache, v_cache, req_to_token, req_rows, kv_lens, table, mid_out, mid_lse, out,
        scale, num_splits, num_prefix_splits, batch, prefix_slots, suffix_programs, *common, table.stride(0),
        *scratch, *out.stride()[:2],
        KV_HEADS=num_kv_heads,
        GROUP=group,
        G_MAX=group_max,
        G_PAD=triton.next_power_of_2(group_max),
        M_PAD=max(16, triton.next_power_of_2(group_max * group)),
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        PREFIX_SPLITS_PAD=triton.next_power_of_2(num_prefix_splits),
        BLOCK_N=block_n,
        PREFIX_BLOCK_N=prefix_block_n,
        GROUP_SUFFIX=group_suffix,
        FINAL=final,
        **meta,
    )  # fmt: skip
    if not final:
        launch_stage2(
            mid_out[:batch, :, :total_splits], mid_lse[:batch, :, :total_splits], out, total_splits, pdl=False
        )
    return out


def shared_prefix_decode_ref(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    kv_lens: torch.Tensor,
    table: torch.Tensor,  # [B, 1 + G_MAX]
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """The definition: row b attends to its group's first P keys through its leader's req_to_token row, then to
    its own keys [P, kv_len) through its own row (decode_attention_ref over a table that splices the two)."""
    spare = req_to_token.shape[0]  # row spare + b: row b's spliced slots
    spliced = torch.cat([req_to_token, req_to_token.new_zeros(q.shape[0], req_to_token.shape[1])])
    own_rows = req_rows.clone()
    prefix_lens = table[:, 0].tolist()
    for row_members in table[:, 1:].tolist():  # group g's positions in row g, the leader first
        members = [p for p in row_members if p >= 0]
        for position in members:
            prefix = prefix_lens[position]
            spliced[spare + position] = req_to_token[int(req_rows[position])]
            spliced[spare + position, :prefix] = req_to_token[int(req_rows[members[0]]), :prefix]
            own_rows[position] = spare + position
    return decode_attention_ref(q, k_cache, v_cache, spliced, own_rows, kv_lens, scale, softcap=softcap)
