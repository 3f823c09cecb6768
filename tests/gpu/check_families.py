"""GPU check (not CI) of the newer families against transformers on tiny random models: ModelRunner with
the Triton backend, Triton layer ops and decode CUDA graphs, in float32 and bfloat16, over prefill
chunks, a mixed step and graph-replayed decode steps past the sliding window or attention chunk (16, 70-token
sequences); the fused-experts kernel runs for the MoE families. Exits non-zero on a miss.

A family that misses in float32 is then bisected in float32 (VARIANTS): the torch layer ops (all, or only
the fused sandwich norms), Gemma's GeGLU in torch, the torch attention backend, no CUDA graphs, transformers'
reference computed on the CPU, each soft-cap off in both models. Each line gives the worst error of the
prefill chunk, the extend step and the decode steps, so the variant that brings the family back within
tolerance names the culprit. A JSON line ends the run.

Run on the device:  PYTHONPATH=$PWD python3 -m tests.gpu.check_families
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, fields, replace

import torch
import transformers
import triton

import tgi_compat.modeling.models.gemma
import tgi_compat.modeling.runner
from tests.modeling.helpers import max_rel_error, run_step, tiny_hf_model
from tgi_compat.kernels.elementwise.silu_mul import gelu_tanh_mul_ref
from tgi_compat.modeling.layers.ops import TORCH_OPS, LayerOps, select_ops
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig

SIZES = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3)
SIZES |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64)
WINDOW = 16
FAMILIES = {
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, attn_logit_softcapping=20.0, final_logit_softcapping=15.0)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 1 + ["sliding_attention"]),
    ),
    "phi3": ("Phi3Config", dict(pad_token_id=0)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=256),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True),
    ),
    "mistral-window": ("MistralConfig", dict(sliding_window=WINDOW)),
    "olmo2 (fallback)": ("Olmo2Config", {}),
    # local layers in chunks of WINDOW tokens, the third layer global and NoPE with its query temperature by position
    "llama4 (fallback)": (
        "Llama4TextConfig",
        dict(attention_chunk_size=WINDOW, floor_scale=8, intermediate_size_mlp=512, num_local_experts=4),
    ),
}
# (max rel error, min argmax agreement). bfloat16 is judged on agreement only: on random tiny models a
# rounding difference flips an MoE routing choice or a near-tie now and then (measured on CPU: MoE rel
# errors up to 1.1 where the argmax still agrees on 81-99% of positions).
TOLERANCE = {"float32": (2e-3, 0.99), "bfloat16": (float("inf"), 0.8)}


@dataclass(frozen=True)
class Variant:
    """One way to run a family: which of our parts run and where transformers' reference runs."""

    torch_ops: tuple[str, ...] = ()  # LayerOps fields taken from TORCH_OPS (their unfused torch ops), "all": every one
    torch_geglu: bool = False  # Gemma's GeGLU as torch ops instead of the Triton kernel it takes on CUDA
    attention_backend: str | None = None  # None: the runner's choice (Triton on CUDA)
    graphs: bool = True  # decode steps replay CUDA graphs
    reference_on_cpu: bool = False  # transformers' logits computed on the CPU in float32
    config: tuple[tuple[str, object], ...] = ()  # config overrides for both models


VARIANTS = {
    "as served": Variant(),
    "torch layer ops": Variant(torch_ops=("all",)),
    "unfused sandwich norms": Variant(torch_ops=("norm_add_norm_linear",)),
    "torch GeGLU": Variant(torch_geglu=True),
    "torch attention backend": Variant(attention_backend="torch", graphs=False),
    "no CUDA graphs": Variant(graphs=False),
    "reference on CPU": Variant(reference_on_cpu=True),
    "no attention soft-cap": Variant(config=(("attn_logit_softcapping", None),)),
    "no final soft-cap": Variant(config=(("final_logit_softcapping", None),)),
}
STEP_NAMES = ("prefill", "extend", "decode")


def run_family(config_name: str, overrides: dict, dtype: str, device: str, variant: Variant = Variant()):
    """[(logits, reference, step of each logits row)] of the three requests."""
    model = tiny_hf_model(getattr(transformers, config_name), **{**SIZES, **overrides, **dict(variant.config)})
    hf_config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
    model = model.to(device)
    cfg = RunnerConfig(
        device=device,
        dtype=dtype,
        attention_backend=variant.attention_backend,
        num_kv_slots=4096,
        max_rows=8,
        max_seq_len=512,
        cuda_graph_batch_sizes=[1, 2, 4] if variant.graphs else [],
    )
    chosen_ops, triton_geglu = (
        tgi_compat.modeling.runner.select_ops,
        tgi_compat.modeling.models.gemma.triton_gelu_tanh_mul_linear,
    )
    if variant.torch_ops:
        ops = select_ops(torch.device(device))
        unfused = [f.name for f in fields(LayerOps)] if variant.torch_ops == ("all",) else variant.torch_ops
        ops = replace(ops, **{name: getattr(TORCH_OPS, name) for name in unfused})
        tgi_compat.modeling.runner.select_ops = lambda _device: ops
    if variant.torch_geglu:
        tgi_compat.modeling.models.gemma.triton_gelu_tanh_mul_linear = lambda x, proj: proj(gelu_tanh_mul_ref(x))
    try:
        runner = ModelRunner.from_hf_state_dict(hf_config, model.state_dict(), cfg)
        results, graphs = _run_requests(runner, model, dtype, device, variant.reference_on_cpu)
    finally:
        tgi_compat.modeling.runner.select_ops = chosen_ops
        tgi_compat.modeling.models.gemma.triton_gelu_tanh_mul_linear = triton_geglu
    return results, graphs, model.config._attn_implementation


def _run_requests(runner: ModelRunner, model, dtype: str, device: str, reference_on_cpu: bool):
    g = torch.Generator().manual_seed(0)
    lengths = (70, 45, 9)
    seqs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
    if reference_on_cpu:
        ref_model, ref_device = model.to("cpu", torch.float32), "cpu"
    else:
        ref_model, ref_device = model.to(torch.bfloat16 if dtype == "bfloat16" else torch.float32), device
    with torch.no_grad():
        refs = [ref_model(torch.tensor([s], device=ref_device)).logits[0].float().to(device) for s in seqs]
    base = [0, 100, 200]
    cached = [n - 6 for n in lengths]
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    steps: list[list[int]] = [[] for _ in seqs]
    first = run_step(runner, [(i, seqs[i][:20], 0, list(range(base[i], base[i] + 20))) for i in (0, 1)])
    for i in (0, 1):
        outs[i].append(first[i])
        steps[i] += [0] * first[i].shape[0]
    second = run_step(
        runner,
        [(i, seqs[i][20 : cached[i]], 20, list(range(base[i] + 20, base[i] + cached[i]))) for i in (0, 1)]
        + [(2, seqs[2][: cached[2]], 0, list(range(base[2], base[2] + cached[2])))],
    )
    for i in range(3):
        outs[i].append(second[i])
        steps[i] += [1] * second[i].shape[0]
    for step in range(6):  # batched decode steps: these replay the CUDA graph of bucket 4
        reqs = [(i, [s[cached[i] + step]], cached[i] + step, [base[i] + cached[i] + step]) for i, s in enumerate(seqs)]
        for i, logits in enumerate(run_step(runner, reqs)):
            outs[i].append(logits.clone())
            steps[i].append(2)
    graphs = runner.cuda_graphs is not None
    results = [(torch.cat(outs[i]), refs[i], torch.tensor(steps[i], device=device)) for i in range(3)]
    return results, graphs


def check(name: str, config_name: str, overrides: dict, dtype: str, device: str) -> bool:
    results, graphs, _ = run_family(config_name, overrides, dtype, device)
    max_err, min_agree = TOLERANCE[dtype]
    ok = True
    for i, (got, ref, _) in enumerate(results):
        err = max_rel_error(got, ref)
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        passed = err <= max_err and agree >= min_agree
        ok &= passed
        print(
            f"{name:18s} {dtype:8s} req {i}: rel err {err:.2e}, argmax agree {agree:.3f}, graphs {graphs} {'ok' if passed else 'MISS'}"
        )
    return ok


def bisect(name: str, config_name: str, overrides: dict, device: str) -> dict[str, dict[str, float]]:
    """Worst float32 error over the three requests, per step kind, of each variant of one family."""
    table = {}
    for label, variant in VARIANTS.items():
        results, _, attention = run_family(config_name, overrides, "float32", device, variant)
        errors = {}
        for kind, step_name in enumerate(STEP_NAMES):
            worst = 0.0
            for got, ref, steps in results:
                rows = steps == kind
                if rows.any():
                    worst = max(worst, max_rel_error(got[rows], ref[rows]))
            errors[step_name] = worst
        table[label] = errors
        cells = ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
        verdict = "ok" if max(errors.values()) <= TOLERANCE["float32"][0] else "MISS"
        print(f"  {name} float32 {label:24s} {cells} {verdict} (transformers' attention: {attention})")
    return table


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"  # "cpu": a dry run of this script (torch backend)
    print(
        f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, "
        f"layer ops {select_ops(torch.device(device)).name}"
    )
    ok = True
    missed = []
    for name, (config_name, overrides) in FAMILIES.items():
        for dtype in ("float32", "bfloat16"):
            passed = check(name, config_name, overrides, dtype, device)
            ok &= passed
            if not passed and dtype == "float32":
                missed.append(name)
    bisections = {}
    for name in missed:
        print(f"bisecting {name} (float32 worst rel err per step kind; tolerance {TOLERANCE['float32'][0]:.0e}):")
        config_name, overrides = FAMILIES[name]
        bisections[name] = bisect(name, config_name, overrides, device)
    print(json.dumps({"ok": ok, "missed_float32": missed, "bisections": bisections}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
