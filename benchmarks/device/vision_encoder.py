"""Where Qwen2.5-VL's vision encoder spends its time (issue 41): the 7B's vision tower (random bf16 weights) over 1 and
8 images of 1024x1024 (grid 74x74 each; the processor's tensors made directly, shape-correct), each part timed over
all 32 blocks with CUDA events, with its TFLOP/s; then every attention backend of the encoder's seam
(tgi_compat/modeling/vision/qwen2_5_vl.py: VISION_ATTENTION) on the window and the full blocks and in the whole
encoder, each against the fp32 reference; then a sweep of the Triton kernel's tiles.

    python3 -m benchmarks.device.vision_encoder                 # ~1-2 min on an H100 / H200
    python3 -m benchmarks.device.vision_encoder --device cpu    # the CPU smoke (tiny tower, Triton interpreted)

Parts run alone on the inputs a real forward gives them (events around `--reps` calls after a warm-up); "sum of
parts" against the whole `encode` shows what the forward loses between them (launch gaps, host work). The "fused"
rows time the repo's existing Triton rotary and RMSNorm(+residual) kernels on the same tensors: what replacing
transformers' fp32-upcasting modules with them would save. A markdown table on stdout, JSON in
$OUT/vision_encoder.json.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from benchmarks.device.timing import Timer

# nothing here imports Triton at module level: the smoke run sets TRITON_INTERPRET first, which Triton reads on import

TILES: list[tuple[int, int, int, int]] = [
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 32, 4, 2),
    (128, 64, 8, 2),
    (128, 64, 4, 2),
    (128, 32, 8, 3),
]


def build(preset: str, device: str, dtype: torch.dtype) -> tuple[Any, tuple[int, int]]:
    """The encoder (random weights, as transformers initialises them) and a --size image's patch grid."""
    from benchmarks.device.qwen_vl import PRESETS
    from tgi_compat.modeling.dtypes import default_dtype
    from tgi_compat.modeling.vision.qwen2_5_vl import QWEN2_5_VL, QwenVLVisionEncoder

    vision: dict[str, Any] = PRESETS[preset][1]
    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):  # as the runner builds it
        encoder = QwenVLVisionEncoder({"vision_config": vision}, QWEN2_5_VL).eval()
    return encoder, (vision["patch_size"], vision["spatial_merge_size"])


def image_grid(preset: str, size: int, patch: int, merge: int) -> list[int]:
    """transformers' smart_resize at the released min/max_pixels -> [t, h, w] patches of one size x size image."""
    from benchmarks.device.qwen_vl import PRESETS
    from tgi_compat.modeling.vision.qwen2_5_vl import PlaceholderGrid

    _, _, min_pixels, max_pixels = PRESETS[preset]
    rows, columns = PlaceholderGrid(patch * merge, min_pixels, max_pixels)(size, size)
    return [1, rows * merge, columns * merge]


@dataclass
class Inputs:
    """One forward's tensors at each part's input, computed once (values do not change a part's time)."""

    pixels: torch.Tensor
    grid: torch.Tensor  # on the host, as the encoder's forward passes it
    layout: Any  # WindowLayout
    hidden: torch.Tensor
    normed: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attended: torch.Tensor  # [T, C]
    gate: torch.Tensor  # [T, I]

    @classmethod
    def of(cls, encoder: Any, grid: torch.Tensor, device: str, dtype: torch.dtype) -> Inputs:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

        from tgi_compat.modeling.vision.qwen2_5_vl import WindowLayout, patch_embed
        from tgi_compat.modeling.vision.qwen_vl_ops import SDPA

        visual, block = encoder.visual, encoder.visual.blocks[0]
        patch = visual.patch_embed.proj.weight[0].numel()
        pixels = torch.randn(int(grid.prod(-1).sum()), patch, device=device).to(dtype)
        layout = WindowLayout.of(grid, visual.config, pixels.device)
        hidden = layout.to_windows(patch_embed(visual.patch_embed.proj, pixels))
        cos, sin = (layout.to_windows(f) for f in visual.rotary_pos_emb(hidden, layout.position_ids))
        normed = block.norm1(hidden)
        q, k, v = block.attn.qkv(normed).reshape(hidden.shape[0], 3, block.attn.num_heads, -1).unbind(1)
        q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
        attended = SDPA.attend(q, k, v, layout.windows, block.attn.scaling).reshape(hidden.shape)
        return cls(pixels, grid, layout, hidden, normed, cos, sin, q, k, v, attended, block.mlp.gate_proj(normed))


def attention_flop(spans: Any, width: int) -> float:
    """QK^T and PV of every sequence: 4 * L^2 * (heads * head_dim)."""
    return sum(4.0 * rows.shape[0] * rows.shape[1] ** 2 * width for rows in spans.groups)


def parts(encoder: Any, x: Inputs, time_ms: Timer) -> dict[str, dict[str, float]]:
    """Each part over all blocks: {name: {ms, flop, calls}}."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    from tgi_compat.modeling.vision.qwen2_5_vl import WindowLayout, patch_embed

    visual, blocks = encoder.visual, encoder.visual.blocks
    depth, full = len(blocks), len(encoder.full_blocks)
    tokens, width = x.hidden.shape
    inner = visual.config.intermediate_size  # the checkpoint's (the encoder pads it with zeros: no FLOPs)
    merged_width = visual.merger.hidden_size
    attn = blocks[0].attn
    backend, full_backend = encoder.backend, encoder.full_backend

    def per_block(fn: Callable[[Any], object], which: range | list[int] = range(depth)) -> Callable[[], None]:
        def run() -> None:
            for index in which:
                fn(blocks[index])

        return run

    def layout_work() -> None:
        layout = WindowLayout.of(x.grid, visual.config, x.pixels.device)
        for rows in (x.hidden, x.cos, x.sin):
            layout.to_windows(rows)
        layout.from_windows(x.hidden[: tokens // 4])

    window_blocks = [i for i in range(depth) if i not in encoder.full_blocks]
    cases: dict[str, tuple[Callable[[], object], int, float]] = {
        "patch_embed (one GEMM)": (
            lambda: patch_embed(visual.patch_embed.proj, x.pixels),
            1,
            2.0 * tokens * x.pixels.shape[1] * width,
        ),
        "layout (host + permutes)": (layout_work, 1, 0.0),
        "norms": (per_block(lambda b: (b.norm1(x.hidden), b.norm2(x.hidden))), 2 * depth, 0.0),
        "qkv": (per_block(lambda b: b.attn.qkv(x.normed)), depth, 2.0 * tokens * width * 3 * width * depth),
        "rotary": (
            lambda: (
                visual.rotary_pos_emb(x.hidden, x.layout.position_ids),
                per_block(lambda b: apply_rotary_pos_emb_vision(x.q, x.k, x.cos, x.sin))(),
            ),
            depth,
            0.0,
        ),
        f"attention window ({backend.name})": (
            per_block(lambda b: backend.attend(x.q, x.k, x.v, x.layout.windows, attn.scaling), window_blocks),
            depth - full,
            attention_flop(x.layout.windows, width) * (depth - full),
        ),
        f"attention full ({full_backend.name})": (
            per_block(
                lambda b: full_backend.attend(x.q, x.k, x.v, x.layout.images, attn.scaling),
                sorted(encoder.full_blocks),
            ),
            full,
            attention_flop(x.layout.images, width) * full,
        ),
        "proj": (per_block(lambda b: b.attn.proj(x.attended)), depth, 2.0 * tokens * width * width * depth),
        "mlp gemms": (
            per_block(lambda b: (b.mlp.gate_proj(x.normed), b.mlp.up_proj(x.normed), b.mlp.down_proj(x.gate))),
            3 * depth,
            6.0 * tokens * width * inner * depth,
        ),
        "mlp act * up": (per_block(lambda b: b.mlp.act_fn(x.gate) * x.gate), depth, 0.0),
        "residual adds": (per_block(lambda b: (x.hidden + x.attended, x.hidden + x.attended)), 2 * depth, 0.0),
        "merger": (
            lambda: visual.merger(x.hidden),
            1,
            2.0 * tokens / 4 * merged_width * (merged_width + visual.merger.mlp[2].out_features),
        ),
    }
    out = {name: dict(ms=time_ms(fn), flop=flop, calls=calls) for name, (fn, calls, flop) in cases.items()}
    out["whole encode"] = dict(ms=time_ms(lambda: encoder.encode(x.pixels, x.grid)), flop=sum_flop(out), calls=1)
    out.update(fused(encoder, x, time_ms))  # after the sum: the alternatives' flops stay out of it
    return out


def sum_flop(rows: dict[str, dict[str, float]]) -> float:
    return sum(row["flop"] for row in rows.values())


def fused(encoder: Any, x: Inputs, time_ms: Timer) -> dict[str, dict[str, float]]:
    """What some rows above would cost done otherwise, on the same tensors: the encoder's fused elementwise ops
    (TRITON_ELEMENTWISE: the repo's Triton rotary in place and RMSNorm + residual add kernels, fp32 math, the MLP's
    one [gate | up] GEMM and SiLU-and-mul) over all blocks, and the patch embedding as transformers runs it (a Conv3d) beside the encoder's one GEMM."""
    from tgi_compat.modeling.vision.qwen_vl_ops import TRITON_ELEMENTWISE as FUSED

    blocks, proj = encoder.visual.blocks, encoder.visual.patch_embed.proj
    tables = FUSED.tables(x.cos, x.sin)
    q, k = x.q.clone(), x.k.clone()

    def rotary() -> None:
        for _ in blocks:
            FUSED.rotary(q, k, tables)

    def norms() -> None:
        for block in blocks:
            for norm in (block.norm1, block.norm2):
                FUSED.norm(x.attended, norm, x.hidden)

    def mlp() -> None:
        for block in blocks:
            FUSED.mlp(block.mlp, x.normed)

    depth, flop = len(blocks), 2.0 * x.pixels.shape[0] * proj.weight.numel()
    window_blocks = depth - len(encoder.full_blocks)
    qkv = torch.stack((x.q, x.k, x.v), 1)  # [T, 3, H, D], as the projection's output is viewed
    scale = blocks[0].attn.scaling

    def roped_windows() -> None:
        assert FUSED.windows is not None
        for _ in range(window_blocks):
            FUSED.windows(qkv, tables, x.layout.windows, scale)

    mlp_flop = 6.0 * x.normed.numel() * encoder.visual.config.intermediate_size * depth
    window_flop = attention_flop(x.layout.windows, x.q.shape[1] * x.q.shape[2]) * window_blocks
    rows = {}
    for name, fn, calls, flops in (
        ("rotary, fused Triton", rotary, depth, 0.0),
        ("window blocks: rotary and attention in one Triton kernel", roped_windows, window_blocks, window_flop),
        ("mlp: one gate|up GEMM, fused SiLU-and-mul, down", mlp, 3 * depth, mlp_flop),
        ("norms + residual adds, fused Triton", norms, 2 * depth, 0.0),
        ("patch_embed as transformers' Conv3d", lambda: encoder.visual.patch_embed(x.pixels), 1, flop),
    ):
        try:
            ms = time_ms(fn)
        except Exception as error:  # reported beside the table's NaN, not fatal
            print(f"{name}: {type(error).__name__}: {error}", flush=True)
            ms = float("nan")
        rows[name] = dict(ms=ms, flop=flops, calls=calls)
    return rows


def backends(encoder: Any, x: Inputs, names: list[str], time_ms: Timer, check: bool) -> dict[str, dict]:
    """Each attention backend: window and full blocks' ms (28 and 4 calls), error vs fp32 sdpa, and the whole
    encoder's ms per image with each elementwise choice (VISION_ELEMENTWISE)."""
    from tgi_compat.modeling.vision.qwen_vl_ops import SDPA, VISION_ATTENTION, VISION_ELEMENTWISE

    depth, full = len(encoder.visual.blocks), len(encoder.full_blocks)
    scale = encoder.visual.blocks[0].attn.scaling
    q32, k32, v32 = (t.float() for t in (x.q, x.k, x.v))
    images = int(x.grid.shape[0])
    out: dict[str, dict] = {}
    default = encoder.backend, encoder.full_backend, encoder.elementwise
    for name in names:
        backend = VISION_ATTENTION[name]
        row: dict[str, Any] = {}
        try:  # a backend this torch or device lacks is reported, not fatal
            for kind, spans, calls in (("window", x.layout.windows, depth - full), ("full", x.layout.images, full)):
                row[f"{kind}_ms"] = calls * time_ms(functools.partial(backend.attend, x.q, x.k, x.v, spans, scale))
                if check:
                    ref = SDPA.attend(q32, k32, v32, spans, scale)
                    got = backend.attend(x.q, x.k, x.v, spans, scale).float()
                    row[f"{kind}_rel_err"] = ((got - ref).norm() / ref.norm()).item()
            for ops in VISION_ELEMENTWISE.values():  # the whole encoder with each elementwise choice
                encoder.backend, encoder.full_backend, encoder.elementwise = backend, backend, ops
                row[f"encode_ms_per_image_{ops.name}"] = time_ms(lambda: encoder.encode(x.pixels, x.grid)) / images
        except Exception as error:
            row = dict(error=f"{type(error).__name__}: {error}"[:300])
        finally:
            encoder.backend, encoder.full_backend, encoder.elementwise = default
        out[name] = row
    return out


def queue_times(encoder: Any, x: Inputs, busy_ms: float = 200.0) -> dict[str, float]:
    """Host ms to queue work while the device is still busy with `busy_ms` of a sleep kernel (as the engine queues an
    encoder call while the step before runs): about `busy_ms` or more means the host waited for the device. The
    encoder's whole call, and copies of 32 KB and 256 KB from pageable memory (the sizes of a 3-image layout's window
    index and rope positions, which WindowLayout copies so). Less than the device's time for the same call: the device
    keeps ahead of the host only where work was queued before it (H100, session 40: ~26 ms for one image)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    cycles = int(1_000_000 * busy_ms / (1e3 * (time.perf_counter() - start)))  # calibrated: ~busy_ms of sleep

    def queued(fn: Callable[[], object]) -> float:
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        start = time.perf_counter()
        fn()
        ms = 1e3 * (time.perf_counter() - start)
        torch.cuda.synchronize()
        return ms

    device = x.pixels.device
    return {
        "encode": queued(lambda: encoder.encode(x.pixels, x.grid)),
        "pageable copy 32 KB": queued(lambda: torch.zeros(4096, dtype=torch.int64).to(device, non_blocking=True)),
        "pageable copy 256 KB": queued(lambda: torch.zeros(32768, dtype=torch.int64).to(device, non_blocking=True)),
        "busy ms": busy_ms,
    }


def tile_sweep(x: Inputs, scale: float, time_ms: Timer, tiles: list[tuple[int, int, int, int]]) -> list[dict]:
    """The Triton varlen kernel at each (block_m, block_n, num_warps, num_stages), one call a kind of span."""
    from tgi_compat.kernels.attention.varlen import varlen_attention

    out = []
    for block_m, block_n, warps, stages in tiles:
        row: dict[str, Any] = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        for kind, spans in (("window", x.layout.windows), ("full", x.layout.images)):
            args = (x.q, x.k, x.v, spans.cu_seqlens, spans.longest, scale, block_m, block_n, warps, stages)
            try:
                row[f"{kind}_ms"] = time_ms(functools.partial(varlen_attention, *args))
            except Exception as error:  # a tile past the shared memory: reported, not fatal
                row[f"{kind}_ms"] = None
                row["error"] = type(error).__name__
        out.append(row)
    return out


def table(report: dict) -> str:
    lines = [f"Qwen2.5-VL vision encoder, {report['preset']}, {report['dtype']}, grid {report['grid']} per image", ""]
    for count, result in report["counts"].items():
        lines += [
            f"### {count} image(s) per call",
            "",
            "| part | calls | ms | ms/image | TFLOP/s |",
            "|---|---|---|---|---|",
        ]
        for name, row in result["parts"].items():
            tflops = f"{row['flop'] / row['ms'] / 1e9:.0f}" if row["flop"] and row["ms"] > 0 else "-"
            lines.append(f"| {name} | {row['calls']} | {row['ms']:.2f} | {row['ms'] / int(count):.2f} | {tflops} |")
        lines += [
            "",
            f"sum of parts (unfused rows) {result['sum_ms']:.2f} ms, whole encode {result['whole_ms']:.2f} ms",
            "",
        ]
        elementwise = [key.removeprefix("encode_ms_per_image_") for key in _encode_keys(result["backends"])]
        lines += [
            "| attention | window ms (all blocks) | full ms | rel err window / full | encoder ms/image: "
            + " | ".join(f"{name} elementwise" for name in elementwise)
            + " |",
            "|---|---|---|---|" + "---|" * len(elementwise),
        ]
        for name, row in result["backends"].items():
            if "error" in row:
                lines.append(f"| {name} | {row['error']} |" + " |" * (2 + len(elementwise)))
                continue
            err = f"{row['window_rel_err']:.1e} / {row['full_rel_err']:.1e}" if "window_rel_err" in row else "-"
            encode = [f"{row.get(f'encode_ms_per_image_{ops}', float('nan')):.2f}" for ops in elementwise]
            lines.append(f"| {name} | {row['window_ms']:.2f} | {row['full_ms']:.2f} | {err} | {' | '.join(encode)} |")
        lines.append("")
        if "queue_ms" in result:
            queue = dict(result["queue_ms"])
            lines += [f"host ms to queue, the device busy for {queue.pop('busy ms'):.0f} ms: "]
            lines += ["; ".join(f"{name} {ms:.1f}" for name, ms in queue.items()), ""]
    lines += ["### Triton varlen tiles (one call)", "", "| block_m, block_n, warps, stages | window ms | full ms |"]
    lines.append("|---|---|---|")
    for row in report["tiles"]:
        ms = [f"{row[k]:.3f}" if row[k] is not None else row.get("error", "-") for k in ("window_ms", "full_ms")]
        lines.append(
            f"| {row['block_m']}, {row['block_n']}, {row['num_warps']}, {row['num_stages']} | {ms[0]} | {ms[1]} |"
        )
    return "\n".join(lines)


def _encode_keys(rows: dict[str, dict]) -> list[str]:
    """The whole-encoder columns of the backends' rows, in their order (one per VISION_ELEMENTWISE choice)."""
    keys: dict[str, None] = {}
    for row in rows.values():
        keys.update((key, None) for key in row if key.startswith("encode_ms_per_image_"))
    return list(keys)


UNFUSED = (
    "whole encode",
    "rotary, fused Triton",
    "window blocks: rotary and attention in one Triton kernel",
    "norms + residual adds, fused Triton",
    "patch_embed as transformers' Conv3d",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", choices=("7b", "tiny"), default=None, help="default: 7b on cuda, tiny on cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--size", type=int, default=None, help="image side in pixels (default 1024; cpu 112)")
    parser.add_argument("--counts", default=None, help="images per encoder call (default 1,8; cpu 1,2)")
    parser.add_argument("--backends", default=None, help="default: triton,flash,sdpa (cpu: sdpa,triton)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    cpu = args.device == "cpu"
    if cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton import: the kernels run interpreted
    preset, size = args.preset or ("tiny" if cpu else "7b"), args.size or (112 if cpu else 1024)
    dtype = getattr(torch, args.dtype or ("float32" if cpu else "bfloat16"))
    names = (args.backends or ("sdpa,triton" if cpu else "triton,flash,sdpa")).split(",")
    from benchmarks.device.timing import out_path, timer, write_json

    time_ms = timer(args.device, args.reps)
    start = time.perf_counter()
    encoder, (patch, merge) = build(preset, args.device, dtype)
    grid_one = image_grid(preset, size, patch, merge)
    report: dict[str, Any] = dict(preset=preset, dtype=str(dtype), size=size, grid=grid_one, counts={})
    report["build_s"] = time.perf_counter() - start
    if not cpu:
        report.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    with torch.inference_mode():
        for count in map(int, (args.counts or ("1,2" if cpu else "1,8")).split(",")):
            x = Inputs.of(encoder, torch.tensor([grid_one] * count), args.device, dtype)
            rows = parts(encoder, x, time_ms)
            result: dict[str, Any] = dict(parts=rows, whole_ms=rows["whole encode"]["ms"])
            result["sum_ms"] = sum(row["ms"] for name, row in rows.items() if name not in UNFUSED)
            result["backends"] = backends(encoder, x, names, time_ms, check=count == 1)
            if not cpu:
                result["queue_ms"] = queue_times(encoder, x)
            report["counts"][str(count)] = result
            print(f"{count} image(s): {time.perf_counter() - start:.0f} s", flush=True)
        tiles = TILES[:2] if cpu else TILES
        report["tiles"] = tile_sweep(x, encoder.visual.blocks[0].attn.scaling, time_ms, tiles)
    print(table(report), flush=True)
    write_json(out_path("vision_encoder.json"), report)


if __name__ == "__main__":
    main()
