"""Qwen2.5-VL's and Qwen2-VL's vision encoders (our packed forward over transformers' modules) against transformers'
own vision transformers on the same weights (fp32, within 1e-3): images of several windows each, windows cut short
at the right and bottom edges, full-attention layers (Qwen2-VL's in every block); several images in one call equal
each image alone; the image files
through ImageEncoder (the processor image by image in its thread pool, then one encoder call) equal the processor's
own batch."""

from __future__ import annotations

import io

import pytest
import torch

from tests.modeling.helpers import max_rel_error
from tests.modeling.qwen2_5_vl_helpers import FAMILIES, MERGE, PATCH, picture, tiny_qwen2_5_vl
from tgi_compat.kernels.elementwise.silu_mul import silu_mul_ref
from tgi_compat.modeling.vision.encoder import ImageEncoder
from tgi_compat.modeling.vision.qwen2_5_vl import VISION_TOWERS, QwenVLVisionEncoder
from tgi_compat.modeling.vision.qwen_vl_mlp import MLP_ALIGN
from tgi_compat.modeling.vision.qwen_vl_ops import VISION_ATTENTION, VISION_ELEMENTWISE
from tgi_compat.modeling.vision.qwen_vl_pixels import RESIZED

# (color, (width, height)): grids of 8x10, 4x6 and 4x14 patches, so 2x3, 1x2 and 1x4 windows of 2x2 merged patches,
# the last column of windows cut short
IMAGES = [((200, 30, 60), (150, 100)), ((10, 220, 90), (84, 56)), ((40, 40, 250), (200, 60))]


def encoder_pair(family: str = "qwen2_5_vl"):
    """(transformers' vision transformer, our encoder on its weights)."""
    model = tiny_qwen2_5_vl(300, family=family)
    encoder = QwenVLVisionEncoder(model.config.to_dict(), VISION_TOWERS[type(model).__name__])
    params = dict(encoder.visual.named_parameters())  # through the loaders: the MLP is padded (PaddedSwiGLU)
    for name, tensor in model.model.visual.state_dict().items():
        params[name].weight_loader(params[name], tensor)  # type: ignore[attr-defined]
    return model.model.visual.eval(), encoder.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    return encoder_pair(request.param)


def processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 64, patch_size=PATCH, merge_size=MERGE)


def processed(images):
    return processor()(images=[picture(color, size) for color, size in images], return_tensors="pt")


def test_encoder_equals_transformers_vision_transformer(pair):
    reference, encoder = pair
    inputs = processed(IMAGES)
    assert len(torch.unique(inputs["image_grid_thw"], dim=0)) == len(IMAGES)
    with torch.no_grad():
        expected = reference(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
    rows = encoder(dict(inputs))
    assert [r.shape[0] for r in rows] == (inputs["image_grid_thw"].prod(-1) // MERGE**2).tolist()
    assert max_rel_error(torch.cat(rows), expected) < 1e-3


def test_the_mlp_width_is_padded_and_checkpoints_load_into_its_corner():
    """Qwen2.5-VL's MLP width off the 64 grid (the tiny model's 60, the 7B's 3420) is padded with zeros (its GEMMs
    on cuBLAS's fast kernels); the tests above show the same outputs. A tensor of another shape than the checkpoint's
    is refused."""
    reference, encoder = encoder_pair()
    mlp, hf_mlp = encoder.visual.blocks[0].mlp, reference.blocks[0].mlp
    assert hf_mlp.gate_proj.out_features == 60
    assert (mlp.gate_proj.out_features, mlp.up_proj.out_features, mlp.down_proj.in_features) == (MLP_ALIGN,) * 3
    assert torch.equal(mlp.down_proj.weight[:, :60], hf_mlp.down_proj.weight)
    assert not mlp.down_proj.weight[:, 60:].any() and not mlp.gate_proj.bias[60:].any()
    wrong = torch.zeros(MLP_ALIGN, mlp.gate_proj.in_features)  # (the padded shape: a checkpoint has 60 rows)
    with pytest.raises(ValueError, match="shape mismatch"):
        mlp.gate_proj.weight.weight_loader(mlp.gate_proj.weight, wrong)


def test_the_fused_mlp_equals_transformers_mlp():
    """The gate and up weights load into the two halves of one tensor (views of it), so the fused path's one GEMM
    and SiLU-and-mul (the Triton kernel on a GPU; its reference here) gives transformers' MLP."""
    reference, encoder = encoder_pair()
    mlp, hf_mlp = encoder.visual.blocks[1].mlp, reference.blocks[1].mlp
    assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up_weight.data_ptr()
    assert torch.equal(mlp.gate_up_weight[MLP_ALIGN : MLP_ALIGN + 60], hf_mlp.up_proj.weight)
    x = torch.randn(7, mlp.gate_proj.in_features)
    with torch.no_grad():
        expected = hf_mlp(x)
        assert max_rel_error(mlp(x), expected) < 1e-5
        assert max_rel_error(mlp.fused(x, silu_mul_ref), expected) < 1e-5


@pytest.mark.parametrize("elementwise", sorted(VISION_ELEMENTWISE))
@pytest.mark.parametrize("backend", sorted(VISION_ATTENTION))
def test_every_choice_equals_transformers_on_cpu(backend, elementwise):
    """A CUDA-only choice (Triton, FlashAttention) leaves CPU tensors to the reference, so any choice serves."""
    reference, encoder = encoder_pair()
    encoder.backend = encoder.full_backend = VISION_ATTENTION[backend]
    encoder.elementwise = VISION_ELEMENTWISE[elementwise]
    inputs = processed(IMAGES[:2])
    with torch.no_grad():
        expected = reference(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
    assert max_rel_error(torch.cat(encoder(dict(inputs))), expected) < 1e-3


def test_images_in_one_call_equal_each_alone(pair):
    _, encoder = pair
    together = encoder(dict(processed(IMAGES)))
    for image, rows in zip(IMAGES, together):
        (alone,) = encoder(dict(processed([image])))
        assert max_rel_error(rows, alone) < 1e-4


class EncoderModel:
    """The VisionLanguageModel seam of ImageEncoder over the encoder alone (the text model plays no part here)."""

    def __init__(self, encoder: QwenVLVisionEncoder) -> None:
        self.encode_processed = encoder


def test_image_files_through_the_thread_pool_equal_the_processors_batch(pair, tmp_path):
    reference, encoder = pair
    processor().save_pretrained(tmp_path)
    files = []
    for color, size in IMAGES:
        out = io.BytesIO()
        picture(color, size).save(out, format="PNG")
        files.append(out.getvalue())
    images = ImageEncoder(EncoderModel(encoder), str(tmp_path), torch.device("cpu"))
    batch = processed(IMAGES)
    ours = images.preprocess_all(files)
    assert set(ours) == set(batch) and torch.equal(ours["image_grid_thw"], batch["image_grid_thw"])
    # the pool sends the resized image as uint8 and the flattening and normalisation run on the device
    # (vision/qwen_vl_pixels.py): the processor's own values to float32 rounding
    resized = images.preprocess(files[0])[RESIZED]
    assert resized.dtype == torch.uint8 and resized.shape == (4 * PATCH * MERGE, 5 * PATCH * MERGE, 3)
    torch.testing.assert_close(ours["pixel_values"], batch["pixel_values"], rtol=0, atol=1e-6)
    with torch.no_grad():
        expected = reference(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output
    assert max_rel_error(torch.cat(images.encode([images.preprocess(data) for data in files])), expected) < 1e-3
