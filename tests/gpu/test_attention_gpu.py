"""GPU correctness of the attention kernels vs their references at real shapes (marker `gpu`;
skipped without CUDA, so CI collects and skips them).

Run on the device:  PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu
Thresholds (METHOD.md): relative L2 error vs an fp32 reference; fp32 kernels < 1e-4 (ieee dots),
bf16/fp16 < 1e-2; NaN never passes; outputs are poisoned with NaN before each run.
End to end: random small Llama and Qwen2; fp32 greedy ids of the triton backend (with CUDA graphs)
equal the torch backend's and transformers'; bf16 logits (teacher-forced) within 2e-2 relative.
"""

from __future__ import annotations

import itertools

import torch

from tests.gpu.kernel_checks import DEV, GPU_ONLY, check, every_check_passes, paged_cache, rel_err, tolerance  # noqa: F401
from tgi_compat.kernels.attention.decode import (
    choose_block_n,
    choose_num_splits,
    decode_attention,
    decode_attention_ref,
)
from tgi_compat.kernels.attention.decode_rotary import NewTokenKV
from tgi_compat.kernels.attention.prefill import prefill_attention, prefill_attention_ref, token_spans
from tgi_compat.kernels.attention.rotary import rotary_and_kv_store

pytestmark = GPU_ONLY


def test_decode_attention() -> None:
    for heads, kv_heads, head_dim in [(32, 8, 128), (28, 4, 128), (16, 16, 64)]:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            kv_lens = [1, 4097, 37, 1500, 64, 3000, 2, 777]
            k_cache, v_cache, r2t, rows = paged_cache(kv_lens, kv_heads, head_dim, dtype)
            q = torch.randn(len(kv_lens), heads, head_dim, device=DEV, dtype=dtype)
            kv = torch.tensor(kv_lens, device=DEV)
            ref = decode_attention_ref(q, k_cache, v_cache, r2t, rows, kv, head_dim**-0.5)
            for splits in (1, 5, choose_num_splits(len(kv_lens), kv_heads, 132)):
                for block_n in (64, 128):
                    out = torch.full_like(q, float("nan"))
                    decode_attention(
                        q, k_cache, v_cache, r2t, rows, kv, head_dim**-0.5, splits, out=out, block_n=block_n
                    )
                    check(
                        f"decode {heads}/{kv_heads}x{head_dim} {dtype} splits={splits} block={block_n}",
                        rel_err(out, ref),
                        tolerance(dtype),
                    )


def test_decode_attention_merged() -> None:
    """Stage 2 merged into stage 1 (ticket counter): real shapes, both block sizes, the batch-1 split
    counts, two calls on one counter, and the counter back at zero after each."""
    shapes = [
        (32, 8, 128, torch.bfloat16),
        (32, 8, 128, torch.float32),
        (28, 4, 128, torch.bfloat16),
        (16, 16, 64, torch.bfloat16),
    ]
    for (heads, kv_heads, head_dim, dtype), kv_lens in itertools.product(
        shapes, ([1, 4097, 37, 1500, 64, 3000, 2, 777], [513], [8191])
    ):
        k_cache, v_cache, r2t, rows = paged_cache(kv_lens, kv_heads, head_dim, dtype)
        kv = torch.tensor(kv_lens, device=DEV)
        counter = torch.zeros(len(kv_lens) + 1, kv_heads, device=DEV, dtype=torch.int32)
        for splits, block_n in itertools.product(
            sorted({5, 33, choose_num_splits(len(kv_lens), kv_heads, 132)}), (64, 128)
        ):
            errors = []
            for _ in range(2):  # the second call finds the counter the first one left
                q = torch.randn(len(kv_lens), heads, head_dim, device=DEV, dtype=dtype)
                out = torch.full_like(q, float("nan"))
                decode_attention(
                    q,
                    k_cache,
                    v_cache,
                    r2t,
                    rows,
                    kv,
                    head_dim**-0.5,
                    splits,
                    out=out,
                    block_n=block_n,
                    split_counter=counter,
                )
                errors.append(rel_err(out, decode_attention_ref(q, k_cache, v_cache, r2t, rows, kv, head_dim**-0.5)))
            torch.cuda.synchronize()
            errors.append(0.0 if not counter.any() else float("inf"))
            check(
                f"decode merged {heads}/{kv_heads}x{head_dim} {dtype} B={len(kv_lens)} L<={max(kv_lens)} "
                f"splits={splits} block={block_n} (2 calls, counter reset)",
                max(errors),
                tolerance(dtype),
            )


def test_decode_attention_merged_graph_replays() -> None:
    """One CUDA graph of the merged kernel replayed with new queries and lengths: every replay starts
    from the counter the previous one left."""
    heads, kv_heads, head_dim, max_len = 32, 8, 128, 4096
    k_cache, v_cache, r2t, rows = paged_cache([max_len], kv_heads, head_dim, torch.bfloat16)
    q = torch.randn(1, heads, head_dim, device=DEV, dtype=torch.bfloat16)
    kv = torch.tensor([max_len], device=DEV)
    out = torch.empty_like(q)
    counter = torch.zeros(2, kv_heads, device=DEV, dtype=torch.int32)

    def step():
        decode_attention(
            q, k_cache, v_cache, r2t, rows, kv, head_dim**-0.5, 33, out=out, block_n=128, split_counter=counter
        )

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    worst = 0.0
    for kv_len in (513, 514, 4096, 1, 2000, 130):
        q.copy_(torch.randn_like(q))
        kv.fill_(kv_len)
        out.fill_(float("nan"))
        graph.replay()
        worst = max(worst, rel_err(out, decode_attention_ref(q, k_cache, v_cache, r2t, rows, kv, head_dim**-0.5)))
    torch.cuda.synchronize()
    check("decode merged bf16 B=1 splits=33: 6 graph replays, lengths 1..4096", worst, 1e-2)
    check("decode merged graph replays: counter back at zero", 0.0 if not counter.any() else float("inf"), 1e-12)


def test_decode_attention_fused_rotary() -> None:
    """Rotary + KV store inside flash-decoding vs the separate rotary_and_kv_store kernel + the reference."""
    from tgi_compat.modeling.config import RopeScaling
    from tgi_compat.modeling.layers.rotary import build_cos_sin

    cos_table, sin_table = build_cos_sin(128, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), 8192)
    for heads, kv_heads in [(32, 8), (28, 4)]:
        for kv_lens in ([513], [1], [8191], [1, 4097, 37, 1500, 64, 3000, 2, 777]):
            for merged in (True, False):
                batch, dtype = len(kv_lens), torch.bfloat16
                k_cache, v_cache, r2t, rows = paged_cache(kv_lens, kv_heads, 128, dtype)
                kv = torch.tensor(kv_lens, device=DEV)
                slots = r2t[rows, kv - 1].long()
                k_cache[slots], v_cache[slots] = float("nan"), float("nan")
                qkv = torch.randn(batch, (heads + 2 * kv_heads) * 128, device=DEV, dtype=dtype)
                qk = qkv[:, : (heads + kv_heads) * 128].view(batch, heads + kv_heads, 128)
                v = qkv[:, (heads + kv_heads) * 128 :].view(batch, kv_heads, 128)
                positions = (kv - 1).cpu()
                cos, sin = cos_table[positions].to(DEV, dtype), sin_table[positions].to(DEV, dtype)
                k_ref, v_ref = k_cache.clone(), v_cache.clone()
                qk_ref = qk.clone()
                rotary_and_kv_store(qk_ref, v, cos, sin, k_ref, v_ref, slots, heads)
                ref = decode_attention_ref(qk_ref[:, :heads], k_ref, v_ref, r2t, rows, kv, 128**-0.5)
                counter = torch.zeros(batch, kv_heads, device=DEV, dtype=torch.int32) if merged else None
                out = torch.full((batch, heads, 128), float("nan"), device=DEV, dtype=dtype)
                splits = 33 if batch == 1 else choose_num_splits(batch, kv_heads, 132)
                decode_attention(
                    qk[:, :heads],
                    k_cache,
                    v_cache,
                    r2t,
                    rows,
                    kv,
                    128**-0.5,
                    splits,
                    out=out,
                    block_n=128,
                    split_counter=counter,
                    new_token=NewTokenKV(k=qk[:, heads:], v=v, cos=cos, sin=sin, slots=slots),
                )
                name = f"decode fused rotary {heads}/{kv_heads}x128 bf16 B={batch} L<={max(kv_lens)} merged={merged}"
                check(f"{name}: output", rel_err(out, ref), 1e-2)
                check(f"{name}: new k in the cache", rel_err(k_cache[slots], k_ref[slots]), 1e-2)
                same_v = torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
                k_cache[slots] = k_ref[slots]  # everything else must be untouched
                same_k = torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
                check(f"{name}: v and the rest of the cache (exact)", 0.0 if same_v and same_k else float("inf"), 1e-12)


def test_prefill_attention() -> None:
    for heads, kv_heads, head_dim in [(32, 8, 128), (28, 4, 128)]:
        for dtype in (torch.bfloat16, torch.float32):
            q_lens = [1, 300, 1000, 77, 1, 129]
            kv_lens = [1, 300, 1500, 141, 2001, 129]
            k_cache, v_cache, r2t, rows = paged_cache(kv_lens, kv_heads, head_dim, dtype)
            q_len_t = torch.tensor(q_lens, device=DEV)
            q_start = q_len_t.cumsum(0) - q_len_t
            q = torch.randn(sum(q_lens), heads, head_dim, device=DEV, dtype=dtype)
            args = (q, k_cache, v_cache, r2t, rows, q_start, q_len_t, torch.tensor(kv_lens, device=DEV))
            out = torch.full_like(q, float("nan"))
            prefill_attention(*args, max_q_len=max(q_lens), scale=head_dim**-0.5, out=out)
            ref = prefill_attention_ref(*args, scale=head_dim**-0.5)
            check(f"prefill {heads}/{kv_heads}x{head_dim} {dtype}", rel_err(out, ref), tolerance(dtype))


def test_attention_compiles_once_across_split_counts_and_metadata_offsets() -> None:
    """What varies from step to step (the split count, the partial LSEs' strides, metadata views at any offset)
    is not a specialisation key: after the first launch of each kernel variant, new values compile nothing
    (a compile mid-serving stalls every request ~1 s). Split counts 9-16 share stage 2's SPLITS_PAD."""
    from triton import knobs

    compiled: list[str] = []

    def count(*args, **kwargs) -> bool:
        compiled.append(kwargs["fn"].name)
        return False

    heads, kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    kv_lens = [1, 4097, 37, 1500, 64, 3000, 2, 777, 5]
    k_cache, v_cache, r2t, rows = paged_cache(kv_lens, kv_heads, head_dim, dtype)
    meta = torch.tensor([0, *kv_lens, *kv_lens], device=DEV)  # one step buffer, read as views at any offset
    scale = head_dim**-0.5
    previous, knobs.runtime.jit_post_compile_hook = knobs.runtime.jit_post_compile_hook, count
    try:
        for step, (batch, splits) in enumerate([(8, 9), (9, 13), (7, 16), (8, 11), (9, 16)]):
            offset = step % 2  # int64 views: 16-byte aligned or not
            kv = meta[1 + offset : 1 + offset + batch]
            q = torch.randn(batch, heads, head_dim, device=DEV, dtype=dtype)
            out = decode_attention(q, k_cache, v_cache, r2t, rows[:batch], kv, scale, splits)
            ref = decode_attention_ref(q, k_cache, v_cache, r2t, rows[:batch], kv, scale)
            check(f"decode batch {batch} splits {splits} offset {offset}", rel_err(out, ref), tolerance(dtype))
            q_lens = meta.new_tensor([3, 1, 20][: 2 + offset])
            n = len(q_lens)
            prefill_meta = torch.cat([meta.new_zeros(offset), q_lens.cumsum(0) - q_lens, q_lens, q_lens + 10])
            starts, lens, kv_after = (prefill_meta[offset + i * n : offset + (i + 1) * n] for i in range(3))
            q = torch.randn(int(q_lens.sum()), heads, head_dim, device=DEV, dtype=dtype)
            args = (q, k_cache, v_cache, r2t, rows[:n], starts, lens, kv_after)
            out = prefill_attention(*args, max_q_len=int(q_lens.max()), scale=scale)
            check(f"prefill offset {offset}", rel_err(out, prefill_attention_ref(*args, scale=scale)), tolerance(dtype))
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    for name in ("_decode_stage1_kernel", "_decode_stage2_kernel", "_prefill_kernel"):
        check(f"{name}: compiles", compiled.count(name), 2, "count")  # at most one (none if compiled before)


def test_backend_compiles_every_mixed_step_decode_variant_at_start() -> None:
    """After TritonAttentionBackend.compile_kernels, a MIXED step's decode rows compile nothing at any batch size."""
    from triton import knobs

    from tgi_compat.modeling.attention.base import AttentionParams, AttentionShape
    from tgi_compat.modeling.attention.triton_backend import TritonAttentionBackend, TritonAttentionMetadata

    heads, kv_heads, head_dim, max_rows, dtype = 32, 8, 128, 80, torch.bfloat16
    backend = TritonAttentionBackend(AttentionShape(heads, kv_heads, head_dim, max_rows, 64, torch.device(DEV), dtype))
    kv_cache = (torch.randn(4096, kv_heads, head_dim, device=DEV, dtype=dtype),) * 2
    req_to_token = torch.randint(0, 4096, (max_rows + 1, 64), device=DEV, dtype=torch.int32)
    params = [AttentionParams(head_dim**-0.5), AttentionParams(head_dim**-0.5, sliding_window=16)]
    backend.compile_kernels(kv_cache, req_to_token, params)
    compiled: list[str] = []

    def count(*args, **kwargs) -> bool:
        compiled.append(kwargs["fn"].name)
        return False

    previous, knobs.runtime.jit_post_compile_hook = knobs.runtime.jit_post_compile_hook, count
    try:
        for batch in (1, 3, 16, 17, 33, 47, 80):
            kv_lens = torch.randint(1, 65, (batch,), device=DEV)
            rows = torch.randperm(max_rows, device=DEV)[:batch]
            splits, block_n = backend._num_splits(batch), choose_block_n(batch, kv_heads, backend.num_sms)
            backend.metadata = TritonAttentionMetadata(
                True, req_to_token, rows, rows, kv_lens, kv_lens, rows[:0], 1, splits, block_n
            )
            q = torch.randn(batch, heads, head_dim, device=DEV, dtype=dtype)
            out = backend.forward(q, *kv_cache, params[0])
            ref = decode_attention_ref(q, *kv_cache, req_to_token, rows, kv_lens, head_dim**-0.5)
            check(f"backend decode at batch {batch}", rel_err(out, ref), tolerance(dtype))
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    check("compiles after compile_kernels", len(compiled), 1, "count")


def test_chunked_attention_at_llama4_shape() -> None:
    """Llama 4's local layers (40/8 heads x 128, chunks of 8192 keys at real scale; 512 here so contexts cross
    several): decode (split over the chunk, merged or not) and extend over a cached prefix vs their references."""
    heads, kv_heads, head_dim, chunk, scale = 40, 8, 128, 512, 128**-0.5
    kv_lens = [1, 512, 513, 1500, 2047, 3000]  # a chunk's first key, its last, the next chunk's first, ...
    for dtype in (torch.bfloat16, torch.float32):
        k_cache, v_cache, r2t, rows = paged_cache(kv_lens, kv_heads, head_dim, dtype)
        kv = torch.tensor(kv_lens, device=DEV)
        q = torch.randn(len(kv_lens), heads, head_dim, device=DEV, dtype=dtype)
        ref = decode_attention_ref(q, k_cache, v_cache, r2t, rows, kv, scale, attention_chunk=chunk)
        for splits, merged in ((1, False), (8, False), (8, True)):
            counter = torch.zeros(len(kv_lens), kv_heads, dtype=torch.int32, device=DEV) if merged else None
            out = torch.full_like(q, float("nan"))
            decode_attention(
                q, k_cache, v_cache, r2t, rows, kv, scale, splits, out=out, split_counter=counter, attention_chunk=chunk
            )
            check(f"chunked decode {dtype} splits={splits} merged={merged}", rel_err(out, ref), tolerance(dtype))
        q_lens = torch.tensor([1, 300, 513, 700, 47, 1000], device=DEV)  # chunks over cached prefixes, crossing edges
        starts = torch.cumsum(q_lens, 0) - q_lens
        q = torch.randn(int(q_lens.sum()), heads, head_dim, device=DEV, dtype=dtype)
        args = (q, k_cache, v_cache, r2t, rows, starts, q_lens, kv)
        out = prefill_attention(*args, max_q_len=int(q_lens.max()), scale=scale, attention_chunk=chunk)
        ref = prefill_attention_ref(*args, scale=scale, attention_chunk=chunk)
        check(f"chunked prefill {dtype}", rel_err(out, ref), tolerance(dtype))


def test_prefill_attention_with_image_spans_at_gemma3_shape() -> None:
    """Gemma 3 27B's heads (32/16 x 128), its 256-token images opened both ways, a local layer's window (1024;
    128 here, shorter than an image's reach back from its end) and none: two images in one prompt, one whose chunk
    starts inside it over a cached prefix, a decode and a prompt without any beside them."""
    heads, kv_heads, head_dim, scale = 32, 16, 128, 128**-0.5
    q_lens = [1, 700, 400, 129]
    kv_lens = [900, 700, 1000, 129]
    spans = [[], [(10, 266), (300, 556)], [(580, 836)], []]  # request 2's chunk starts at 600, inside its image
    for dtype, window in itertools.product((torch.bfloat16, torch.float32), (None, 128)):
        k_cache, v_cache, r2t, rows = paged_cache(kv_lens, kv_heads, head_dim, dtype)
        q_len_t = torch.tensor(q_lens, device=DEV)
        q_start = q_len_t.cumsum(0) - q_len_t
        q = torch.randn(sum(q_lens), heads, head_dim, device=DEV, dtype=dtype)
        args = (q, k_cache, v_cache, r2t, rows, q_start, q_len_t, torch.tensor(kv_lens, device=DEV))
        opened = token_spans(spans, q_lens, kv_lens).to(DEV)
        out = torch.full_like(q, float("nan"))
        prefill_attention(*args, max_q_len=max(q_lens), scale=scale, out=out, sliding_window=window, spans=opened)
        ref = prefill_attention_ref(*args, scale=scale, sliding_window=window, spans=opened)
        check(f"prefill with image spans {dtype} window={window}", rel_err(out, ref), tolerance(dtype))


def test_backend_compiles_the_image_span_variants_at_start() -> None:
    """With image_spans, compile_kernels leaves nothing for a Gemma 3 image prefill to compile: its local and
    global layers' span variants, on q as the layers hand it (a view of q|k|v rows), in the runner's dtype."""
    from triton import knobs

    from tgi_compat.modeling.attention.base import AttentionParams, AttentionShape
    from tgi_compat.modeling.attention.triton_backend import TritonAttentionBackend

    heads, kv_heads, head_dim, dtype = 32, 16, 128, torch.bfloat16
    q_lens, kv_lens, spans = [300], [300], [[(10, 266)]]
    backend = TritonAttentionBackend(AttentionShape(heads, kv_heads, head_dim, 4, 512, torch.device(DEV), dtype))
    k_cache, v_cache, r2t, rows = paged_cache(kv_lens, kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    params = [AttentionParams(scale, sliding_window=128, softcap=None), AttentionParams(scale)]
    backend.compile_kernels((k_cache, v_cache), r2t, params, image_spans=True)
    compiled: list[str] = []

    def count(*args, **kwargs) -> bool:
        compiled.append(kwargs["fn"].name)
        return False

    qkv = torch.randn(sum(q_lens), heads + 2 * kv_heads, head_dim, device=DEV, dtype=dtype)
    q = qkv[:, :heads]
    lens = torch.tensor(q_lens, device=DEV)
    args = (q, k_cache, v_cache, r2t, rows, lens - lens, lens, torch.tensor(kv_lens, device=DEV))
    opened = token_spans(spans, q_lens, kv_lens).to(DEV)
    previous, knobs.runtime.jit_post_compile_hook = knobs.runtime.jit_post_compile_hook, count
    try:
        for p in params:
            out = prefill_attention(
                *args, max_q_len=max(q_lens), scale=scale, sliding_window=p.sliding_window, spans=opened
            )
            ref = prefill_attention_ref(*args, scale=scale, sliding_window=p.sliding_window, spans=opened)
            check(f"span prefill window={p.sliding_window}", rel_err(out, ref), tolerance(dtype))
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    check("span prefill compiles after compile_kernels", len(compiled), 1, "count")
