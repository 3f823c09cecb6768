"""SmoothQuant: move activation outliers into the weights before int8 W8A8 quantization.

Per input channel j of the projections behind each RMSNorm (q|k|v, gate|up):
s_j = max|X_j|^alpha / max|W_j|^(1 - alpha); the norm's weight is divided by s and the projections'
columns multiplied by it, which leaves the product unchanged and flattens X for per-token int8.
max|X_j| comes from running calibration tokens through our own model with hooks on those inputs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from tqdm.auto import tqdm

from tgi_compat.modeling.forward_batch import build_forward_batch

# smoothed projection (our fused module) -> (the norm before it, the HF projections it fuses)
_SMOOTHED = {
    "self_attn.qkv_proj": ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "mlp.gate_up_proj": ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
}


@torch.inference_mode()
def activation_absmax(runner, samples: Iterable[list[int]], show_progress: bool = True) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| seen by every smoothed projection: {"model.layers.N.<proj>": [hidden]}."""
    stats: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in runner.model.named_modules():
        if any(name.endswith(proj) for proj in _SMOOTHED):

            def record(mod, args, name=name):
                seen = args[0].abs().amax(0).float()
                stats[name] = torch.maximum(stats[name], seen) if name in stats else seen

            hooks.append(module.register_forward_pre_hook(record))
    try:
        for ids in tqdm(list(samples), desc="Calibrating", unit="sample", disable=not show_progress):
            n = len(ids)
            runner.forward(build_forward_batch(ids, [0], [n], [n], list(range(n)), [n - 1], device=runner.device))
    finally:
        for hook in hooks:
            hook.remove()
    return stats


def smooth(weights: dict[str, torch.Tensor], act_max: dict[str, torch.Tensor], alpha: float) -> None:
    """Fold the smoothing factors into `weights` (HF names, float) in place."""
    for fused_name, x_max in act_max.items():
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", fused_name)
        assert match is not None, fused_name  # act_max holds only the hooked decoder-layer modules
        layer, fused = match.groups()
        norm, projections = _SMOOTHED[fused]
        prefix = f"model.layers.{layer}."
        w_max = torch.stack([weights[f"{prefix}{p}.weight"].abs().amax(0).float() for p in projections]).amax(0)
        s = (x_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)).clamp(min=1e-5)
        weights[f"{prefix}{norm}.weight"] = weights[f"{prefix}{norm}.weight"] / s
        for p in projections:
            weights[f"{prefix}{p}.weight"] = weights[f"{prefix}{p}.weight"] * s[None, :]
