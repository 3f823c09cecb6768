"""LoRA on the GPU (marker `gpu`; skipped without CUDA): the shrink and expand kernels against their references
at Llama-3-8B's projections (bf16, r = 16, 8 slots) for 1, 8 and 64 rows of mixed slots and base rows, with and
without serving's prologues, and the folded projections' expand; and LoRA decode steps replayed from the CUDA graphs equal the eager LoRA steps (a small
random Llama in float32, three adapters and base rows in one batch, an adapter copied into a slot after the
capture).

Run on the device:  PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/gpu/test_lora_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.device.lora_kernels import (
    Kernels,
    LoraCase,
    fused_projections,
    lora_call,
    lora_case,
    row_slots,
    slice_ends,
)
from benchmarks.device.overlap import TINY_LLAMA
from benchmarks.device.peft_adapters import write_peft_adapter
from benchmarks.device.steps import build_runner, decode_batch, hf_model, prefill_batch
from benchmarks.shapes import LLAMA3_8B
from tgi_compat.kernels.lora.expand import lora_expand, lora_expand_ref
from tgi_compat.kernels.lora.expand_folded import lora_expand_folded, lora_expand_folded_ref
from tgi_compat.kernels.lora.shrink import NO_PROLOGUE, ShrinkPrologue, lora_shrink, lora_shrink_ref
from tgi_compat.modeling.forward_batch import LoraBatch
from tgi_compat.modeling.layers.linear import Linear
from tgi_compat.modeling.layers.quantization.base import layer_tensor
from tgi_compat.modeling.layers.quantization.fp8 import Fp8LinearMethod, quantize_weight_per_channel
from tgi_compat.modeling.lora.adapter import LoraModule, load_peft_adapter
from tgi_compat.modeling.lora.layer_ops import SILU_MUL
from tgi_compat.modeling.lora.step import lora_step
from tgi_compat.modeling.lora.weights import LoraWeights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
def test_kernels_match_their_references_at_llama3_8b_shapes(name, rows):
    torch.manual_seed(0)
    size_in, slice_outs = fused_projections(LLAMA3_8B)[name]
    slots = row_slots(rows, 8, base_every=3 if rows > 1 else 0)  # every third row on the base model
    with torch.device("cuda"):
        case = lora_case(size_in, slice_outs, slots, 8, 16, torch.bfloat16)
    step, base = case.step, case.out.clone()
    shrunk, shrunk_ref = lora_shrink(case.x, case.a, step), lora_shrink_ref(case.x, case.a, step)
    num_lora = int(step.seg_len.sum())
    err = rel_err(shrunk.rows()[:num_lora], shrunk_ref.rows()[:num_lora])
    print(f"{name} rows={rows}: shrink rel err {err:.2e}")
    assert err < 1e-3  # bf16 products are exact, float32 sums (split over K) in another order
    expected = base.clone()
    lora_call(case)()
    lora_call(LoraCase(case.x, case.a, case.b, expected, step, case.slice_ends), Kernels.REFERENCE)()
    err = rel_err(case.out - base, expected - base)
    print(f"{name} rows={rows}: shrink+expand delta rel err {err:.2e}")
    assert err < 1e-2  # the bf16 output's roundings
    is_base = (slots < 0).cuda()
    assert torch.equal(case.out[is_base], base[is_base])


@pytest.mark.parametrize("rows", [1, 8, 64, 256])
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
def test_folded_expand_matches_its_reference_at_llama3_8b_shapes(name, rows):
    """The expand of a folded projection (its output [base | every slot's shrunk]), bf16, spread rows and base rows."""
    torch.manual_seed(0)
    _, slice_outs = fused_projections(LLAMA3_8B)[name]
    ends = slice_ends(slice_outs)
    slots = row_slots(rows, 8, base_every=3 if rows > 1 else 0).cuda()
    step = lora_step(slots, 8)
    with torch.device("cuda"):
        full = torch.randn(rows, ends[-1] + 8 * len(ends) * 16, dtype=torch.bfloat16)
        b = (torch.randn(8, ends[-1], 16) / 4).to(torch.bfloat16)
    out, expected = lora_expand_folded(full, step, b, ends), lora_expand_folded_ref(full, step, b, ends)
    base = full[:, : ends[-1]]
    err = rel_err(out - base, expected - base)
    print(f"{name} rows={rows}: folded expand delta rel err {err:.2e}")
    assert err < 1e-2  # the bf16 output's roundings
    assert torch.equal(out[slots < 0], base[slots < 0])


@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
def test_kernels_with_serving_prologues_match_their_references_at_llama3_8b_shapes(name, rows):
    """With the prologue serving gives each projection: the norm before q|k|v and gate|up, SiLU-and-mul before
    down, none before o."""
    torch.manual_seed(0)
    size_in, slice_outs = fused_projections(LLAMA3_8B)[name]
    slots = row_slots(rows, 8, base_every=3 if rows > 1 else 0)
    with torch.device("cuda"):
        case = lora_case(size_in, slice_outs, slots, 8, 16, torch.bfloat16)
        x = torch.randn(rows, 2 * size_in, dtype=torch.bfloat16) if name == "down" else case.x
        norm = ShrinkPrologue(torch.rand(size_in, dtype=torch.bfloat16) + 0.5, 1e-5)
    prologue = {"qkv": norm, "gate_up": norm, "down": SILU_MUL}.get(name, NO_PROLOGUE)
    base = case.out.clone()
    two, ref = base.clone(), base.clone()
    lora_expand(two, lora_shrink(x, case.a, case.step, prologue), case.b, case.step, case.slice_ends)
    lora_expand_ref(ref, lora_shrink_ref(x, case.a, case.step, prologue), case.b, case.step, case.slice_ends)
    err = rel_err(two - base, ref - base)
    print(f"{name} rows={rows}: shrink+expand with its prologue, delta rel err {err:.2e}")
    assert err < 1e-2  # the bf16 output's roundings
    is_base = (slots < 0).cuda()
    assert torch.equal(two[is_base], base[is_base])


@pytest.mark.parametrize("rows", [1, 4, 8, 64, 128])
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
@torch.inference_mode()
def test_an_fp8_folded_projection_shrinks_in_its_gemm_at_llama3_8b_shapes(name, rows):
    """An FP8 projection widened by 8 slots of r = 16 (A quantized per row at staging): its base columns are the
    projection's own, its extra columns each slot's shrink, within FP8's error of the exact product. Rows 1 and 4
    take the W8A16 GEMV, 8 and 64 the FP8 GEMM kernel, 128 torch._scaled_mm."""
    torch.manual_seed(0)
    size_in, slice_outs = fused_projections(LLAMA3_8B)[name]
    n = sum(slice_outs)
    with torch.device("cuda"):
        proj = Linear(size_in, n, method=Fp8LinearMethod(is_serialized=False))
        layer_tensor(proj, "weight").data.normal_(0, 0.02)
        proj.method.process_weights_after_loading(proj)
        x = torch.randn(rows, size_in, dtype=torch.bfloat16)
        before = proj(x)
        lora = LoraWeights(proj, ("o_proj",), 8, 16)
    assert lora.a.dtype == torch.float8_e4m3fn and lora.a_scale is not None
    exact_a = torch.randn(8, 16, size_in) / size_in**0.5
    for slot in range(8):
        lora.place(slot, lora.stage({"o_proj": LoraModule(exact_a[slot], torch.zeros(n, 16))}))
    twin = lora.folded_for(rows)
    assert twin is not None
    full = twin(x)
    base_err = rel_err(full[:, :n], before)
    shrunk_err = rel_err(full[:, n:], x.float() @ exact_a.reshape(-1, size_in).cuda().T)
    print(f"{name} rows={rows}: base columns rel err {base_err:.2e}, shrink vs the exact product {shrunk_err:.2e}")
    assert base_err < 1e-2  # the same weight; another tiling of its wider GEMM
    assert shrunk_err < 6e-2  # e4m3 A (and, past 4 rows, e4m3 activations): a few percent


@pytest.mark.parametrize("rows", [8, 300])
@torch.inference_mode()
def test_the_segmented_shrink_reads_an_fp8_a_at_llama3_8b_shapes(rows):
    """Prefill-sized steps over an FP8 base: the segmented shrink on its e4m3 A and row scales."""
    torch.manual_seed(0)
    size_in, slice_outs = fused_projections(LLAMA3_8B)["qkv"]
    slots = row_slots(rows, 8, base_every=3).cuda()
    step = lora_step(slots, 8)
    a, scale = quantize_weight_per_channel(torch.randn(8 * 48, size_in, device="cuda") / size_in**0.5)
    a, scale = a.view(8, 48, size_in), scale.view(8, 48)
    x = torch.randn(rows, size_in, dtype=torch.bfloat16, device="cuda")
    num_lora = int(step.seg_len.sum())
    out = lora_shrink(x, a, step, a_scale=scale).rows()[:num_lora]
    ref = lora_shrink_ref(x, a, step, a_scale=scale).rows()[:num_lora]
    err = rel_err(out, ref)
    print(f"rows={rows}: FP8-A shrink rel err {err:.2e}")
    assert err < 1e-3  # e4m3 -> bf16 is exact; float32 sums in another order


@torch.inference_mode()
def test_lora_decode_replayed_from_the_graph_equals_the_eager_step(tmp_path):
    torch.manual_seed(0)
    max_len = 128
    model, hf_config = hf_model(TINY_LLAMA, torch.float32, "cuda")
    runner = build_runner(
        hf_config, model.state_dict(), "float32", "triton", 8, max_len, "cuda", [1, 2, 4, 8], max_loras=4,
        max_lora_rank=16,
    )  # fmt: skip
    graphs, lora = runner.cuda_graphs, runner.lora
    assert (
        graphs is not None
        and lora is not None
        and set(graphs.graphs) == {(b, w) for b in (1, 2, 4, 8) for w in (False, True)}
    )
    for adapter_id, rank in ((1, 8), (2, 16), (3, 16)):
        folder = write_peft_adapter(tmp_path / f"a{adapter_id}", TINY_LLAMA, rank, seed=adapter_id)
        lora.add(adapter_id, load_peft_adapter(f"a{adapter_id}", str(folder)))
    prompts = [[3 + 7 * r + j for j in range(5 + r)] for r in range(6)]
    slots = torch.tensor([-1, 0, 1, 2, -1, 0], device="cuda")
    first = prefill_with_lora(runner, prompts, max_len, LoraBatch(slots, [(0, 1), (1, 2), (2, 3)]))
    ids, kv_lens = first.argmax(-1), torch.tensor([len(p) for p in prompts], device="cuda")
    # three LoRA steps, a plain one, then slot 3 gets adapter 2 after the capture (copied in place)
    plan = [
        (slots, []),
        (slots, []),
        (slots, []),
        (None, []),
        (torch.tensor([3, -1, 3, 0, -1, 3], device="cuda"), [(3, 2)]),
    ]
    for step_slots, loads in plan:
        kv_lens = kv_lens + 1
        batch = decode_batch(ids, kv_lens, max_len)
        batch.lora = None if step_slots is None else LoraBatch(step_slots, loads)
        assert graphs.can_run(batch)
        replayed = runner.forward(batch).clone()  # the graph (and, first, the slot copy of any load)
        batch.lora = None if step_slots is None else LoraBatch(step_slots, [])
        lora.begin_step(batch)
        eager = runner._forward_eager(batch)
        lora.begin_step(decode_batch(ids, kv_lens, max_len))  # back to no LoRA step
        err = rel_err(replayed, eager)
        print(f"slots {None if step_slots is None else step_slots.tolist()}: graph vs eager rel err {err:.2e}")
        assert err < 1e-3
        assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
        ids = eager.argmax(-1)


def prefill_with_lora(runner, prompts: list[list[int]], max_len: int, lora_batch: LoraBatch) -> torch.Tensor:
    """benchmarks.device.steps.prefill's step, its rows on their adapters: logits of each prompt's last token."""
    batch = prefill_batch(runner, prompts, max_len)
    batch.lora = lora_batch
    return runner.forward(batch)


@torch.inference_mode()
def test_a_slot_load_copies_off_the_step_stream_without_a_host_sync(tmp_path):
    """An adapter's copy into its slot (tgi_compat.modeling.lora.placement) is queued, never waited for by the host,
    and the step stream sees the whole adapter."""
    model, hf_config = hf_model(TINY_LLAMA, torch.bfloat16, "cuda")
    runner = build_runner(
        hf_config, model.state_dict(), "bfloat16", "triton", 8, 128, "cuda", [1], max_loras=2, max_lora_rank=16
    )
    lora = runner.lora
    assert lora is not None
    folder = write_peft_adapter(tmp_path / "a1", TINY_LLAMA, 16, seed=1)
    lora.add(1, load_peft_adapter("a1", str(folder)))
    batch = decode_batch(torch.tensor([5], device="cuda"), torch.tensor([3], device="cuda"), 128)
    batch.lora = LoraBatch(torch.tensor([1], device="cuda"), [(1, 1)])
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora.begin_step(batch, replayed=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    seen = [(weights.a[1].clone(), weights.b[1].clone()) for weights, _ in lora.adapters[1].tensors]  # step stream
    for (a, b), (_, (host_a, host_b)) in zip(seen, lora.adapters[1].tensors):
        assert torch.equal(a.cpu(), host_a) and torch.equal(b.cpu(), host_b)
    host = [t for _, pair in lora.adapters[1].tensors for t in pair]  # one pinned buffer (placement.pinned)
    assert all(t.is_pinned() for t in host) and len({t.untyped_storage().data_ptr() for t in host}) == 1
