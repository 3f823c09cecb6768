"""GPU correctness of the runtime pieces around the kernels (grammar masks from pinned memory, greedy picks,
vocab-sharded embeddings, side-stream copies, weight prefetch), then end to end: random small Llama and Qwen2,
fp32 greedy ids of the triton backend (with CUDA graphs) equal the torch backend's and transformers'; bf16 logits
(teacher-forced) within 2e-2 relative. Marker `gpu`; skipped without CUDA.
"""

from __future__ import annotations

import torch

from benchmarks.device.steps import build_runner, capture_graphs, greedy_generate, hf_model
from benchmarks.shapes import decoder
from tests.gpu.kernel_checks import DEV, GPU_ONLY, check, every_check_passes, rel_err  # noqa: F401 (every_check_passes: autouse)

pytestmark = GPU_ONLY


TINY_FIELDS = dict(max_position_embeddings=1024, initializer_range=0.1, bos_token_id=None, eos_token_id=None)
TINY = {
    "llama": decoder("LlamaForCausalLM", 256, 512, 4, 8, 2, 1000, pad_token_id=0, **TINY_FIELDS),
    "qwen2": decoder("Qwen2ForCausalLM", 224, 512, 3, 7, 1, 1200, pad_token_id=0, **TINY_FIELDS),
}


def hf_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    ids = torch.tensor([prompt], device=DEV)
    # an explicit mask: generate would otherwise treat pad-id tokens inside the prompt as padding
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def explain_mismatch(model, prompts, ours, theirs, runner, max_len) -> None:
    """Where greedy ids diverge from transformers: a near-tie (top-2 margin) or a real logit gap?"""
    for prompt, a, b in zip(prompts, ours, theirs):
        if a == b:
            continue
        step = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        context = torch.tensor([prompt + a[:step]], device=DEV)
        with torch.no_grad():
            hf_logits = model(context).logits[0, -1].float()
        _, our_logits = greedy_generate(runner, [prompt + a[:step]], 1, max_len)
        top2 = hf_logits.topk(2).values
        print(
            f"  diverge at step {step} (len {len(prompt)}): ours {a[step]} vs transformers {b[step]}; "
            f"transformers top-2 margin {float(top2[0] - top2[1]):.2e}; logits rel err "
            f"{rel_err(our_logits[0][0], hf_logits):.2e}",
            flush=True,
        )


def test_grammar_mask_read_from_pinned_host_memory() -> None:
    """GrammarMask keeps a GPU step's bitmask in pinned host memory and its kernels read it there (no copy):
    apply + confine on the device give the torch reference's scores, with and without a row index."""
    from tgi_compat.kernels.sampling.grammar_apply import grammar_apply_ref
    from tgi_compat.kernels.sampling.grammar_confine import grammar_confine_ref
    from tgi_compat.router.sampling.grammar import GrammarMask
    from tgi_compat.router.sampling.sampler import SamplingKernels

    kernels = SamplingKernels.for_device(torch.device(DEV))
    vocab, num_words = 128256, 4008
    scores = torch.randn(64, vocab, device=DEV)
    scores[0, ::5], scores[1, 7], scores[2] = float("nan"), float("inf"), float("-inf")
    for row_index in (None, torch.arange(1, 64, 3, dtype=torch.int32)):
        rows = 64 if row_index is None else row_index.numel()
        bitmask = torch.randint(-(2**31), 2**31, (rows, num_words), dtype=torch.int32)
        pinned_index = None if row_index is None else row_index.pin_memory()
        mask = GrammarMask(bitmask.pin_memory(), pinned_index)
        got = kernels.confine_grammar(kernels.apply_grammar(scores.clone(), mask), mask)
        assert not mask.bitmask.is_cuda  # read in place, not copied
        expected = grammar_apply_ref(scores.cpu(), bitmask, row_index)
        expected = grammar_confine_ref(expected, bitmask, row_index)
        same = torch.equal(got.cpu().isnan(), expected.isnan()) and torch.equal(
            got.cpu().nan_to_num(), expected.nan_to_num()
        )
        check(
            f"grammar mask from pinned memory, row index {row_index is not None}", 0.0 if same else 1.0, 0.5, "differs"
        )


def test_greedy_from_vocab_blocks() -> None:
    """The greedy choice from Llama-3's vocabulary in 2 and 4 padded blocks (as vocab-parallel ranks hold it), their
    partials side by side as the gather leaves them: greedy_pick's ids, its logprobs within 2e-5."""
    from tgi_compat.kernels.sampling.greedy_pick import greedy_block_partials, greedy_merge_blocks, greedy_pick_ref

    vocab = 128256
    for rows, ranks, dtype in [
        (1, 2, torch.bfloat16),
        (64, 2, torch.bfloat16),
        (256, 4, torch.bfloat16),
        (8, 2, torch.float32),
    ]:
        logits = (torch.randn(rows, vocab, device=DEV) * 4).to(dtype)
        logits[0, [9, vocab - 1]] = 50.0  # a tie in the first and the last block: the first wins
        padded = -(-vocab // ranks)
        parts = []
        for rank in range(ranks):
            start = min(rank * padded, vocab)
            size = min(padded, vocab - start)
            block = torch.zeros(rows, padded, device=DEV, dtype=dtype)  # the LM head's block, padding columns zero
            block[:, :size] = logits[:, start : start + size]
            parts.append(greedy_block_partials(block[:, :size], start, vocab))
        ids, packed = greedy_merge_blocks(torch.cat(parts, dim=1), vocab)
        ref_ids, ref_packed = greedy_pick_ref(logits)
        name = f"greedy from {ranks} vocab blocks, {rows} rows {dtype}"
        check(f"{name}: ids", float((ids != ref_ids).sum()), 0.5, "differ")
        check(f"{name}: logprobs", (packed[1] - ref_packed[1]).abs().max().item(), 2e-5, "max abs")


def test_race_pick() -> None:
    """A sampled step's choice at Llama-3's vocabulary against its torch definition: the same ids but for rows
    whose race the GPU's log approximation may settle otherwise (none expected at these sizes: at most one row
    allowed), the logprobs within 2e-5; a row alone picks as in the batch."""
    from tgi_compat.kernels.sampling.race_pick import gumbel_keys, race_pick, race_pick_ref

    for rows in (1, 64, 256):
        scores = torch.randn(rows, 128256, device=DEV) * 4
        keys = gumbel_keys(torch.arange(rows, device=DEV) * 7919, torch.full((rows,), 3, device=DEV))
        sampling = torch.arange(rows, device=DEV) % 4 != 0  # every fourth row greedy
        ids, packed = race_pick(scores, keys, sampling)
        ref_ids, ref_packed = race_pick_ref(scores, keys, sampling)
        check(f"race pick {rows} rows: ids", float((ids != ref_ids).sum()), 1.5, "differ")
        same = ids == ref_ids
        check(f"race pick {rows} rows: logprobs", (packed[1] - ref_packed[1])[same].abs().max().item(), 2e-5, "max abs")
        alone, _ = race_pick(scores[-1:], keys[-1:], sampling[-1:])
        check(f"race pick {rows} rows: the last row alone", float(alone.item() != ids[-1].item()), 0.5, "differs")


def test_greedy_pick() -> None:
    """The all-greedy choice at Llama-3's vocabulary: the torch computation's ids, its logprobs within 2e-5."""
    from tgi_compat.kernels.sampling.greedy_pick import greedy_pick, greedy_pick_ref

    for rows, dtype in [(1, torch.float32), (64, torch.float32), (256, torch.float32), (8, torch.bfloat16)]:
        logits = (torch.randn(rows, 128256, device=DEV) * 4).to(dtype)
        logits[0, [9, 70000]] = 50.0  # a tie in two chunks: the first wins
        ids, packed = greedy_pick(logits)
        ref_ids, ref_packed = greedy_pick_ref(logits)
        check(f"greedy pick {rows} rows {dtype}: ids", float((ids != ref_ids).sum()), 0.5, "differ")
        check(f"greedy pick {rows} rows {dtype}: packed ids", float((packed[0] != ref_packed[0]).sum()), 0.5, "differ")
        check(
            f"greedy pick {rows} rows {dtype}: logprobs",
            (packed[1] - ref_packed[1]).abs().max().item(),
            2e-5,
            "max abs",
        )


def test_vocab_shard_embedding() -> None:
    """The vocab-parallel lookup of one rank's block (tgi_compat.kernels.comm.vocab_embedding): torch's rows and zeros, bit for
    bit, for ids in and out of the block (Llama-3's vocabulary over 2 ranks, the last block padded)."""
    from tgi_compat.kernels.comm.vocab_embedding import vocab_shard_embedding, vocab_shard_embedding_ref

    block = torch.randn(64128, 4096, device=DEV).to(torch.bfloat16)
    ids = torch.randint(0, 128256, (300,), device=DEV)
    for start, size in [(0, 64128), (64128, 64128), (64128, 60000)]:
        got = vocab_shard_embedding(ids, block, start, size)
        same = torch.equal(got, vocab_shard_embedding_ref(ids, block, start, size))
        check(f"vocab shard embedding, block at {start} of {size} rows", 0.0 if same else 1.0, 0.5, "differs")


def test_side_stream_copies() -> None:
    """tgi_compat.modeling.copy_streams: an upload is ready for the next kernel of the compute stream, a download holds what
    the compute stream's kernels queued before it wrote, though both copies run on side streams (a long kernel
    queued first makes any missing wait visible)."""
    from tgi_compat.modeling.copy_streams import download, upload

    busy = torch.randn(4096, 4096, device=DEV)
    for _ in range(3):
        _ = busy @ busy  # the compute stream is busy well past the copies' issue
        host = torch.arange(1 << 16, dtype=torch.int64).pin_memory()
        uploaded = upload(host, torch.device(DEV))
        doubled = uploaded * 2  # queued on the compute stream right after the upload
        pinned = torch.empty_like(host).pin_memory()
        download(doubled, pinned).synchronize()
        check("side-stream upload + download", float((pinned != host * 2).sum()), 0.5, "differ")


def test_weight_prefetch_beside() -> None:
    """tgi_compat.kernels.comm.l2_prefetch at sizes that end mid-chunk and past the tensor leaves the tensor as it was, and
    tgi_compat.modeling.layers.weight_prefetch's fork and join record into a CUDA graph whose replays compute what eager does."""
    from tgi_compat.kernels.comm.l2_prefetch import l2_prefetch
    from tgi_compat.modeling.layers.weight_prefetch import weight_prefetched_beside

    weight = torch.randn(4099, 1027, device=DEV, dtype=torch.bfloat16)  # 8,419,346 bytes: no whole chunk at the end
    before = weight.clone()
    for num_bytes in (16, 100, 16384 + 48, 3 << 20, 8 << 20, 1 << 30):
        l2_prefetch(weight, num_bytes)
    torch.cuda.synchronize()
    check("l2 prefetch leaves its tensor", 0.0 if torch.equal(weight, before) else 1.0, 0.5, "changed")
    x = torch.randn(64, 1027, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(64, 4099, device=DEV, dtype=torch.bfloat16)

    def step() -> None:
        with weight_prefetched_beside(weight, x.shape[0]):
            y = x * 2  # the latency-bound work the prefetch runs beside
        out.copy_(y @ weight.T)

    step()
    expected = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    check("weight prefetch in a CUDA graph", 0.0 if torch.equal(out, expected) else 1.0, 0.5, "differs")


def test_end_to_end() -> None:
    max_len, num_new = 256, 24
    gen = torch.Generator().manual_seed(0)
    for name, config in TINY.items():
        torch.manual_seed(1)
        model, hf_config = hf_model(config, torch.float32)
        prompts = [torch.randint(0, config["vocab_size"], (n,), generator=gen).tolist() for n in (5, 40, 1, 113)]
        state = model.state_dict()
        runners = {b: build_runner(hf_config, state, "float32", b, 8, max_len) for b in ("torch", "triton")}
        graphs = capture_graphs(runners["triton"], [1, 2, 8])  # 4 requests replay bucket 8: 4 padding entries
        ids_torch, _ = greedy_generate(runners["torch"], prompts, num_new, max_len)
        ids_triton, _ = greedy_generate(runners["triton"], prompts, num_new, max_len, graphs=graphs)
        ids_eager, _ = greedy_generate(runners["triton"], prompts, num_new, max_len)
        hf_ids = [hf_greedy(model, p, num_new) for p in prompts]
        check(f"e2e {name} fp32 greedy: triton+graphs == torch backend", 0.0 if ids_triton == ids_torch else 1.0, 0.5)
        check(f"e2e {name} fp32 greedy: triton eager == torch backend", 0.0 if ids_eager == ids_torch else 1.0, 0.5)
        check(f"e2e {name} fp32 greedy: torch backend == transformers", 0.0 if ids_torch == hf_ids else 1.0, 0.5)
        if ids_torch != hf_ids:
            explain_mismatch(model, prompts, ids_torch, hf_ids, runners["torch"], max_len)
        # the same through ModelRunner's own graphs (--cuda-graphs), when the runner has the hook
        hooked = build_runner(hf_config, state, "float32", "triton", 8, max_len, graph_sizes=[1, 2, 8])
        if getattr(hooked, "cuda_graphs", None) is None:
            print(f"NOTE e2e {name}: ModelRunner does not capture CUDA graphs itself (no hook)", flush=True)
        else:
            ids_hooked, _ = greedy_generate(hooked, prompts, num_new, max_len)
            check(
                f"e2e {name} fp32 greedy: ModelRunner(--cuda-graphs 1,2,8) == torch backend",
                0.0 if ids_hooked == ids_torch else 1.0,
                0.5,
            )
        del hooked
        # fp32 logits of each prompt alone (batch 1), the truth for the bf16 batch-1 check below
        truth_b1 = [
            greedy_generate(runners["torch"], [p], num_new, max_len, forced=[f])[1] for p, f in zip(prompts, ids_torch)
        ]
        del runners, graphs
        bf16 = {b: build_runner(hf_config, state, "bfloat16", b, 8, max_len) for b in ("torch", "triton")}
        graphs = capture_graphs(bf16["triton"], [2, 6])
        _, logits_torch = greedy_generate(bf16["torch"], prompts, num_new, max_len, forced=ids_torch)
        _, logits_triton = greedy_generate(bf16["triton"], prompts, num_new, max_len, graphs=graphs, forced=ids_torch)
        worst = max(rel_err(a, b) for a, b in zip(logits_triton, logits_torch))
        check(f"e2e {name} bf16 logits triton vs torch backend (worst step)", worst, 2e-2)
        # Batch 1 takes the one-row path (tgi_compat.kernels.gemv.gemv with the norm / silu_mul fused in, which skips
        # two bf16 roundings): judged against fp32 truth, it must be no less exact than the torch
        # backend's bf16 (the direct triton-vs-torch bf16 error is printed beside it).
        graphs1 = capture_graphs(bf16["triton"], [1])
        err_torch = err_triton = direct = 0.0
        for prompt, forced, truth in zip(prompts, ids_torch, truth_b1):
            _, ref = greedy_generate(bf16["torch"], [prompt], num_new, max_len, forced=[forced])
            err_torch = max(err_torch, *(rel_err(a, b) for a, b in zip(ref, truth)))
            for use_graphs in (graphs1, None):
                _, got = greedy_generate(bf16["triton"], [prompt], num_new, max_len, graphs=use_graphs, forced=[forced])
                err_triton = max(err_triton, *(rel_err(a, b) for a, b in zip(got, truth)))
                direct = max(direct, *(rel_err(a, b) for a, b in zip(got, ref)))
        print(
            f"  batch 1 bf16 vs fp32 truth: torch backend {err_torch:.2e}, triton {err_triton:.2e}; "
            f"triton vs torch bf16 {direct:.2e}",
            flush=True,
        )
        check(
            f"e2e {name} bf16 batch-1 triton (one-row GEMV) error vs fp32 / torch backend's",
            err_triton / err_torch,
            1.25,
        )
        del graphs1
        del bf16, graphs, model
        torch.cuda.empty_cache()
