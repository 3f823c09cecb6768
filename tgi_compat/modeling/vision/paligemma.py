"""PaliGemma's prompt (PaliGemma 1 on Gemma, PaliGemma 2 on Gemma 2; served by the transformers fallback,
models/transformers_vlm.py), as TGI's model server writes it (vlm_causal_lm.py): each image is
`text_config.num_image_tokens` `<image>`s, each piece of text between images is `<bos>` + text + `\\n`, and the
tokenizer adds no special tokens, so `![](...)caption en` is transformers' processor's `<image>`s + `<bos>caption
en\\n`. The model is a prefix LM: the whole prompt attends both ways during prefill (transformers' token_type_ids 0;
TGI's non-causal prefill), generated tokens causally; its positions start at 1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PaliGemmaImageTokens:
    image_token_id: int
    tokens_per_image: int  # (image_size / patch_size)²: 256 at 224 pixels, 1024 at 448, 4096 at 896

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> PaliGemmaImageTokens:
        from transformers import PaliGemmaConfig

        c = PaliGemmaConfig(**{key: value for key, value in d.items() if key != "model_type"})
        text: Any = c.text_config  # a config object once PaliGemmaConfig has read it
        return cls(c.image_token_id, text.num_image_tokens)

    @property
    def text(self) -> str:
        return "<image>" * self.tokens_per_image

    @staticmethod
    def text_piece(text: str) -> str:
        """A piece of the prompt's text, as TGI's preprocess_text wraps it."""
        return f"<bos>{text}\n"
