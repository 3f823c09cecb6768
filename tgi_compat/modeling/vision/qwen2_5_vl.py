"""The vision encoder of Qwen's vision-language family, Qwen2-VL and Qwen2.5-VL: transformers' own vision transformer
(2D rope, the 2x2 patch merger; Qwen2.5-VL's attends within windows but in a few full-attention blocks, Qwen2-VL's
to its whole image in every block) built from the checkpoint's config.json, so its outputs are transformers' by
construction. It takes the flattened patches and (t, h, w) grid of every image from transformers' Qwen2-VL image
processor (both families': dynamic resolution, each image resized to a multiple of 28 pixels within
min_pixels..max_pixels) and gives each image (grid h / 2) * (grid w / 2) rows, one per `<|image_pad|>`
placeholder."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from tgi_compat.kernels.attention.window import WINDOW_TOKENS
from tgi_compat.modeling.layers.linear import default_weight_loader
from tgi_compat.modeling.vision.qwen_vl_mlp import swiglu_mlp
from tgi_compat.modeling.vision.qwen_vl_ops import (
    DEFAULT_FULL_ATTENTION,
    DEFAULT_VISION_ATTENTION,
    DEFAULT_VISION_ELEMENTWISE,
    SDPA,
    TRANSFORMERS,
    Spans,
    Tables,
    VisionAttention,
    VisionElementwise,
)

if TYPE_CHECKING:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionAttention
    from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention as VisionAttention_


def _build_qwen2_5_vl_tower(hf_config: dict[str, Any], dtype: torch.dtype) -> Any:
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    vision = Qwen2_5_VLConfig(**_wrapper_fields(hf_config)).vision_config
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(vision, dtype=dtype)


def _build_qwen2_vl_tower(hf_config: dict[str, Any], dtype: torch.dtype) -> Any:
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    vision = Qwen2VLConfig(**_wrapper_fields(hf_config)).vision_config
    return Qwen2VisionTransformerPretrainedModel._from_config(vision, dtype=dtype)


def _wrapper_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in hf_config.items() if key != "model_type"}


@dataclass(frozen=True, slots=True)
class VisionTower:
    """Which of transformers' two Qwen vision transformers a checkpoint's encoder is: their blocks, rope and merger
    share the names and the forward this module drives; only Qwen2.5-VL's regroups its patches into windows."""

    build: Callable[[dict[str, Any], torch.dtype], Any]  # (the checkpoint's config.json, dtype) -> transformers' tower
    windowed: bool  # Qwen2.5-VL: window attention but in fullatt_block_indexes; Qwen2-VL: whole images always
    rms_norms: bool  # Qwen2.5-VL's norms are RMSNorms (the fused kernels' math); Qwen2-VL's LayerNorms


QWEN2_5_VL = VisionTower(_build_qwen2_5_vl_tower, windowed=True, rms_norms=True)
QWEN2_VL = VisionTower(_build_qwen2_vl_tower, windowed=False, rms_norms=False)
# the family's checkpoints (ModelConfig.multimodal_architecture) -> their tower
VISION_TOWERS = {"Qwen2_5_VLForConditionalGeneration": QWEN2_5_VL, "Qwen2VLForConditionalGeneration": QWEN2_VL}


@dataclass(frozen=True, slots=True)
class QwenVLImageTokens:
    """How an image appears in the prompt: `<|vision_start|>` + one `<|image_pad|>` per merged patch +
    `<|vision_end|>` (TGI's server-side text, vlm_causal_lm.image_text_replacement)."""

    image_token_id: int
    spatial_merge_size: int  # 2: a placeholder stands for merge x merge patches

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> QwenVLImageTokens:
        vision = d.get("vision_config") or {}
        return cls(d.get("image_token_id", 151655), vision.get("spatial_merge_size", 2))


@dataclass(frozen=True, slots=True)
class PlaceholderGrid:
    """An image's (rows, columns) of placeholders: transformers' own `smart_resize` (sides to multiples of
    patch * merge pixels, the area within the processor's min_pixels..max_pixels) over patch * merge."""

    factor: int  # patch_size * merge_size pixels per placeholder side
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_folder(cls, folder: str) -> PlaceholderGrid:
        """From the checkpoint's preprocessor_config.json (the processor the encoder runs)."""
        from tgi_compat.modeling.vision.processors import image_processor

        return cls.of(image_processor(folder))

    @classmethod
    def of(cls, processor: Any) -> PlaceholderGrid:
        size = processor.size  # transformers moves a hub config's min_pixels/max_pixels here
        return cls(processor.patch_size * processor.merge_size, size.shortest_edge, size.longest_edge)

    def __call__(self, height: int, width: int) -> tuple[int, int]:
        # the Pillow processor module: the same function, with no torchvision import
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        resized_height, resized_width = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return resized_height // self.factor, resized_width // self.factor


class QwenVLVisionEncoder(nn.Module):
    """(pixel_values [patches, C * t * p * p], image_grid_thw [N, 3]) -> each image's [(h / 2) * (w / 2), hidden].

    transformers' modules and weights, driven by our own short forward (the same ops in the same order as
    transformers' own) so that every layer's attention is ONE non-causal varlen call over all images of the call:
    transformers' sdpa/eager path loops over each window (each image, Qwen2-VL's) in Python (~100 windows x 28
    layers per 1024px image)."""

    def __init__(
        self,
        hf_config: dict[str, Any],
        tower: VisionTower = QWEN2_5_VL,
        attention: VisionAttention = DEFAULT_VISION_ATTENTION,
        elementwise: VisionElementwise = DEFAULT_VISION_ELEMENTWISE,
        full_attention: VisionAttention = DEFAULT_FULL_ATTENTION,
    ):
        super().__init__()
        self.visual = tower.build(hf_config, torch.get_default_dtype())  # the runner builds under the serving dtype
        self.merge = self.visual.spatial_merge_size
        self.windowed = tower.windowed
        self.rms_norms = tower.rms_norms
        self.backend = attention  # the windows' (where `elementwise` does not attend them itself)
        self.full_backend = full_attention  # whole images' (Qwen2-VL's every block: its windows are its images)
        self.elementwise = elementwise
        # the blocks that attend to whole images (Qwen2-VL's: all of them, which its layout's windows are)
        self.full_blocks = frozenset(self.visual.fullatt_block_indexes if tower.windowed else ())
        for param in self.parameters():  # loaded by models/weight_names.load_packed_weights, as ours are
            param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        for block in self.visual.blocks:
            block.mlp = swiglu_mlp(block.mlp)

    @torch.inference_mode()
    def forward(self, processed: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        # the grid's few numbers on the host before any launch: read back after them, it waited for the whole encoder
        grid = processed["image_grid_thw"].cpu()
        pixels = processed["pixel_values"].to(self.visual.patch_embed.proj.weight.dtype)
        rows = self.encode(pixels, grid)
        return list(torch.split(rows, (grid.prod(-1) // self.merge**2).tolist()))

    def encode(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """transformers' vision transformer's forward -> pooler_output, its attention packed. Each block's
        `hidden + attn(norm1(hidden))` then `+ mlp(norm2(...))`, its residual adds taken by the norm after them."""
        visual, blocks = self.visual, self.visual.blocks
        layout = WindowLayout.of(grid, visual.config, pixels.device, self.windowed)
        backend, full = (b if pixels.is_cuda or b.on_cpu else SDPA for b in (self.backend, self.full_backend))
        ops = self.elementwise
        if not (pixels.is_cuda or ops.on_cpu) or (ops.rms_norm_only and not self.rms_norms):
            ops = TRANSFORMERS
        hidden = layout.to_windows(patch_embed(visual.patch_embed.proj, pixels))
        tables = ops.tables(*(layout.to_windows(f) for f in visual.rotary_pos_emb(hidden, layout.position_ids)))
        normed, hidden = ops.norm(hidden, blocks[0].norm1, None)
        for index, block in enumerate(blocks):
            spans = layout.images if index in self.full_blocks else layout.windows
            attend = full if spans is layout.images else backend
            normed, hidden = ops.norm(
                self.attention(block.attn, normed, tables, spans, attend, ops), block.norm2, hidden
            )
            out = ops.mlp(block.mlp, normed)
            if index + 1 < len(blocks):
                normed, hidden = ops.norm(out, blocks[index + 1].norm1, hidden)
        return layout.from_windows(visual.merger(hidden + out))

    @staticmethod
    def attention(
        attn: Qwen2_5_VLVisionAttention | VisionAttention_,
        hidden: torch.Tensor,
        tables: Tables,
        spans: Spans,
        backend: VisionAttention,
        ops: VisionElementwise,
    ) -> torch.Tensor:
        """The vision attention's forward with one packed call in place of its per-window (per-image) loop."""
        tokens = hidden.shape[0]
        qkv = attn.qkv(hidden).reshape(tokens, 3, attn.num_heads, -1)
        if ops.windows is not None and spans.longest <= WINDOW_TOKENS:
            out = ops.windows(qkv, tables, spans, attn.scaling)
        else:
            q, k, v = qkv.unbind(1)
            q, k = ops.rotary(q, k, tables)
            out = backend.attend(q, k, v, spans, attn.scaling)
        return attn.proj(out.reshape(tokens, -1))


def patch_embed(proj: nn.Conv3d, pixels: torch.Tensor) -> torch.Tensor:
    """transformers' patch embedding: a Conv3d whose kernel is its stride and covers each patch row whole, so one
    GEMM of the rows [patches, C * t * p * p] (the processor's flattening, the weight's own order) with the
    flattened weight; cuDNN's bf16 Conv3d on these shapes is far slower (vLLM runs it as a linear layer too)."""
    weight = proj.weight.reshape(proj.weight.shape[0], -1)  # (a view: loading fills the Conv3d's weight in place)
    return nn.functional.linear(pixels.reshape(-1, weight.shape[1]), weight, proj.bias)


@dataclass(frozen=True, slots=True)
class WindowLayout:
    """Where each patch goes for the window layers (transformers' vision_utils, computed on the host from the
    tiny grid so that no step of the forward waits on the device), and the spans both kinds of layer attend. A
    windowless tower's (Qwen2-VL's) keeps its patches in place, and its windows are its whole images."""

    window_index: torch.Tensor | None  # [patches / merge**2]: merged-patch order of the windows; None: in place
    position_ids: torch.Tensor  # [patches, 2]: each patch's (h, w) for the 2D rope
    windows: Spans
    images: Spans
    unit: int  # merge**2 patches per merged patch

    @classmethod
    def of(cls, grid: torch.Tensor, config: Any, device: torch.device, windowed: bool = True) -> WindowLayout:
        from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

        grid = grid.cpu()
        merge = config.spatial_merge_size
        images = Spans.of(get_vision_cu_seqlens(grid), device)
        index, windows = None, images
        if windowed:
            index, cu_windows = get_vision_window_index(grid, merge, config.window_size, config.patch_size)
            index, windows = index.to(device, non_blocking=True), Spans.of(cu_windows, device)
        return cls(index, get_vision_position_ids(grid, merge).to(device, non_blocking=True), windows, images, merge**2)

    def to_windows(self, rows: torch.Tensor) -> torch.Tensor:
        """transformers' permute_input_for_window_attn: patches regrouped window by window."""
        if self.window_index is None:
            return rows
        return rows.reshape(-1, self.unit, rows.shape[-1])[self.window_index].reshape(rows.shape)

    def from_windows(self, merged: torch.Tensor) -> torch.Tensor:
        """Merged patches back in image order from window order."""
        return merged if self.window_index is None else merged[torch.argsort(self.window_index)]
