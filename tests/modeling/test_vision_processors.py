"""The server loads every image processor with transformers' Pillow backend (tgi_compat/modeling/vision/processors.py),
also where torchvision is installed and transformers would pick its torchvision one: the GPU machine's image has
torchvision, and the GPU runs include this file. The same request then gives the same pixels on every install."""

from __future__ import annotations

import pytest

from tgi_compat.modeling.vision.processors import image_processor


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("transformers.models.qwen2_vl.image_processing_qwen2_vl", "Qwen2VLImageProcessor"),
        ("transformers.models.llava_next.image_processing_llava_next", "LlavaNextImageProcessor"),
        ("transformers.models.gemma3.image_processing_gemma3", "Gemma3ImageProcessor"),
    ],
)
def test_a_saved_processor_loads_as_pillows(tmp_path, module, name):
    import importlib

    pil = importlib.import_module(module.replace("image_processing_", "image_processing_pil_"))
    getattr(pil, f"{name}Pil")().save_pretrained(tmp_path)
    # saved as the torchvision class would be: the name transformers resolves by backend
    config = tmp_path / "preprocessor_config.json"
    config.write_text(config.read_text().replace(f'"{name}Pil"', f'"{name}"'))
    assert type(image_processor(str(tmp_path))).__name__ == f"{name}Pil"
