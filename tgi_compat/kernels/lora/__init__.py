"""Segmented LoRA kernels (SGMV style): the step's tokens sorted by adapter slot, one segment per slot.

shrink: prologue(x) [T, in] -> shrunk [P, T, S * R] (row i belongs to token token_order[i]), through that
token's slot's A (bf16 dots, float32 sums; split over K in P parts at decode sizes, where one slot's few rows would
leave most SMs idle, each part written, not accumulated: no zeroing launch); the prologue is the base projection's
fused one (RMS norm, SiLU-and-mul), so LoRA steps keep the fused base kernels;
expand: out[token, columns of slice s] += shrunk[:, i, s * R : (s + 1) * R].sum(0) @ B[slot, those columns]^T,
all the slices of a fused projection in one launch. Two launches per projection in all (one launch doing both,
each output tile computing its slice's shrink again, was 2-3.6x slower at 1 row on an H100: session 24). The pieces
they share are in tiles.py.
Grids are sized by the token count and --max-loras (never by the live segments): a CUDA graph captured once
replays any mix of adapters. Each kernel sits beside the torch reference that defines it.
"""
