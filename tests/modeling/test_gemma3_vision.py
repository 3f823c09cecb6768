"""Gemma 3 with images, natively: the vision encoder's rows scattered at the placeholders, bidirectional
attention within each image during prefill; logits and greedy text against transformers' own
Gemma3ForConditionalGeneration on the same weights (fp32), with one image and with two."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from tests.modeling.helpers import image_greedy, max_rel_error, runner_for_folder
from tests.modeling.test_gemma3_multimodal import tiny_multimodal
from tgi_compat.modeling.forward_batch import ImageEmbeds, build_forward_batch
from tgi_compat.modeling.models.gemma3_vision import Gemma3ForConditionalGeneration

VOCAB = 300
IMAGE, BOI, EOI = VOCAB - 1, VOCAB - 3, VOCAB - 2
TOKENS_PER_IMAGE = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = tiny_multimodal(VOCAB)
    folder = tmp_path_factory.mktemp("gemma3-vision")
    model.save_pretrained(folder)
    runner = runner_for_folder(str(folder))
    assert isinstance(runner.model, Gemma3ForConditionalGeneration)
    return model, runner


def pixels(*colors: tuple[int, int, int]) -> torch.Tensor:
    processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    images = []
    for i, color in enumerate(colors):  # a gradient, so that patches differ
        image = Image.new("RGB", (40 + 8 * i, 30), color)
        image.putpixel((3, 4), (255 - color[0], 0, 255))
        images.append(image.resize((40 + 8 * i, 30 + 5 * i)))
    return processor(images, return_tensors="pt")["pixel_values"].float()


def prompt(*texts: list[int]) -> list[int]:
    """Text runs joined by images, as TGI's prompt for Gemma 3 puts them."""
    ids = texts[0]
    for text in texts[1:]:
        ids = ids + [BOI] + [IMAGE] * TOKENS_PER_IMAGE + [EOI] + text
    return ids


def reference_logits(model, ids: list[int], pixel_values: torch.Tensor) -> torch.Tensor:
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model(input_ids=input_ids, pixel_values=pixel_values, token_type_ids=(input_ids == IMAGE).long())
    return out.logits[0].float()


def image_embeds(runner, ids: list[int], start: int, features: torch.Tensor) -> ImageEmbeds:
    """The ImageEmbeds of the new tokens ids[start:], features [images, tokens, hidden] in prompt order, every
    image of the prompt at or after `start` (the router's job: chunks never split an image)."""
    rows = [p - start for p in range(start, len(ids)) if ids[p] == IMAGE]
    first = sum(1 for p in range(start) if ids[p] == IMAGE) // TOKENS_PER_IMAGE
    taken = features[first:].reshape(-1, features.shape[-1])[: len(rows)]
    spans = [(start + r, start + r + TOKENS_PER_IMAGE) for r in rows[::TOKENS_PER_IMAGE]]
    return ImageEmbeds(torch.tensor(rows), taken, [spans])


def run(runner, ids: list[int], start: int, slots: list[int], features: torch.Tensor) -> torch.Tensor:
    """One step of the new tokens ids[start:] over the cached ids[:start]; logits of every new token."""
    new = len(ids) - start
    batch = build_forward_batch(ids[start:], [0], [new], [len(ids)], slots[start : len(ids)], list(range(new)))
    if IMAGE in ids[start:]:
        batch.images = image_embeds(runner, ids, start, features)
    return runner.forward(batch)


def text(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB - 10, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_with_images_equal_transformers(pair, num_images):
    model, runner = pair
    pixel_values = pixels((200, 30, 60), (10, 220, 90))[:num_images]
    ids = prompt(text(1, 5), *(text(2 + i, 6) for i in range(num_images)))
    ref = reference_logits(model, ids, pixel_values)
    features = runner.model.encode_images(pixel_values)
    slots = list(range(100, 100 + len(ids)))
    ours = run(runner, ids, 0, slots, features)
    assert max_rel_error(ours, ref) <= 1e-3
    # the prefix up to the last image's end in one chunk, then the rest over the cached prefix
    cut = len(ids) - 6
    first = run(runner, ids[:cut], 0, slots, features)
    rest = run(runner, ids, cut, slots, features)
    assert max_rel_error(torch.cat([first, rest]), ref) <= 1e-3


def test_the_image_changes_the_logits(pair):
    """A different image gives different logits: the features are really in the prompt."""
    _, runner = pair
    ids = prompt(text(1, 5), text(2, 6))
    slots = list(range(len(ids)))
    red = run(runner, ids, 0, slots, runner.model.encode_images(pixels((200, 30, 60))))
    green = run(runner, ids, 0, slots, runner.model.encode_images(pixels((10, 220, 90))))
    assert (red[-1] - green[-1]).abs().max() > 1e-2


def test_greedy_text_equals_transformers_generate(pair):
    model, runner = pair
    pixel_values = pixels((200, 30, 60), (10, 220, 90))
    ids = prompt(text(7, 4), text(8, 3), text(9, 5))
    expected = image_greedy(model, ids, pixel_values, 12)
    slots = list(range(200, 200 + len(ids) + 12))
    features = runner.model.encode_images(pixel_values)
    logits = run(runner, ids, 0, slots, features)
    out = [int(logits[-1].argmax())]
    while len(out) < len(expected):
        seq = ids + out
        out.append(int(run(runner, seq, len(seq) - 1, slots, features)[-1].argmax()))
    assert out == expected
