"""`python -m tgi_compat.quantize`: AIAK's quantization tool command line (the work is tgi_compat.modeling.quantize.tool).

    python -m tgi_compat.quantize -i IN -o OUT -quant_type weight_only_int8|smooth_quant|awq|gptq
        -t bf16|fp16 [-sq 0.8] [-token TOKEN_IDS_FILE] [-tp N] [--multi-query-mode]

IN is anything --model-id takes (folder, .gguf file, hub id); OUT becomes a compressed-tensors
checkpoint (safetensors + config.json + tokenizer) that `text-generation-launcher --model-id OUT` serves.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tgi_compat.quantize", description=__doc__.split("\n")[0])
    parser.add_argument("-i", "--input", required=True, help="model to quantize: folder, .gguf file or hub id")
    parser.add_argument("-o", "--output", required=True, help="folder for the quantized checkpoint")
    parser.add_argument(
        "-quant_type",
        "--quant-type",
        dest="quant_type",
        required=True,
        help="weight_only_int8 | smooth_quant | awq | gptq",
    )
    parser.add_argument("-t", "--dtype", default="bf16", help="bf16 | fp16: dtype of scales and unquantized tensors")
    parser.add_argument(
        "-sq",
        "--smoothquant",
        dest="sq_alpha",
        type=float,
        default=0.8,
        help="SmoothQuant migration strength alpha (smooth_quant)",
    )
    parser.add_argument(
        "-token",
        "--token-ids",
        dest="token_ids_file",
        help="calibration token ids, one sample per line (default: ShareGPT conversations)",
    )
    parser.add_argument(
        "-tp",
        "--tp-size",
        dest="tp",
        type=int,
        default=1,
        help="tensor-parallel size the checkpoint must split for (checked; the server shards it)",
    )
    parser.add_argument(
        "--multi-query-mode",
        action="store_true",
        help="accepted for AIAK's command line; KV heads come from the model's config",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tgi_compat.modeling.quantize.tool import QuantizeError, QuantizeJob, run
    from tgi_compat.modeling.weights.hub import ModelNotFoundError

    try:
        run(QuantizeJob(**vars(args)))
    except (QuantizeError, ModelNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
