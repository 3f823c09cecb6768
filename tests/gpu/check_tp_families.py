"""GPU check (not CI) of tensor parallelism for every sharded family: 2 ranks over NCCL give one GPU's
logits on a tiny random checkpoint of each (Llama with biases, Gemma 1/2/3, Phi-3, Mixtral, Qwen2-MoE,
Qwen3-MoE; `fallback-*`: Starcoder2 and LLaVA-Next's text model on the transformers fallback, as
tests/modeling/test_fallback_tensor_parallel.py runs them, and Mllama's image and text requests, as
tests/modeling/test_mllama_tensor_parallel.py does), and one GPU's pooled outputs for the pooling models
(`pool-*`: a Qwen2 classifier, Qwen2.5-Math-RM's and InternLM2's rewards, a mean-pooled Llama embedding, as
tests/modeling/test_pooling_tensor_parallel.py runs them), through the GPU paths CI's gloo test cannot reach: the Triton attention and layer ops,
the fused-experts kernel on each rank's slice of the experts, the symmetric-memory all-reduce and
decode steps replayed from CUDA graphs. float32 by default; exits non-zero on a miss.

Run on a 2-GPU device:  PYTHONPATH=$PWD python3 -m tests.gpu.check_tp_families [--dtype bfloat16]

The Triton all-reduce takes 16-bit sums only, so float32 sums go to NCCL; `--dtype bfloat16` runs the models the
way they are served, through that kernel (`TGI_SYMMETRIC_ALL_REDUCE=0` beside it gives NCCL's error to compare).
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests.modeling.helpers import max_rel_error, tiny_hf_model
from tests.modeling.mllama_helpers import saved_mllama
from tests.modeling.test_fallback_tensor_parallel import MODELS as FALLBACK_MODELS
from tests.modeling.test_mllama_tensor_parallel import image_steps
from tests.modeling.test_pooling_tensor_parallel import MODELS as POOLING_MODELS
from tests.modeling.test_pooling_tensor_parallel import pool_steps
from tests.modeling.test_tensor_parallel_logits import SHARDED_SIZES, TINY_FAMILIES, _steps
from tgi_compat.modeling.forward_batch import build_forward_batch
from tgi_compat.modeling.parallel import NO_TP, TensorParallel, init_tensor_parallel
from tgi_compat.modeling.parallel.step_broadcast import StepBroadcast
from tgi_compat.modeling.runner import ModelRunner, RunnerConfig
from tgi_compat.router.process_exit import exit_process

# the kernels' reduction order differs between 1 and 2 ranks; bf16 rounds each layer's output besides
TOLERANCE = {"float32": 2e-3, "bfloat16": 5e-2}
SIZES = {**SHARDED_SIZES, "hidden_size": 192, "intermediate_size": 320}  # head_dim 32 where derived
NUM_DECODE_STEPS = 6  # batch-2 decode steps after the test's three: replayed from CUDA graphs
NUM_ONE_ROW_STEPS = 3  # then row 0 alone: the one-row GEMVs, which push o's and down's sums to the peers


def steps() -> list[dict]:
    """The CPU test's prefill, decode and mixed steps, then decode steps of rows 0 and 2, then of row 0."""
    out = _steps()
    for i in range(NUM_DECODE_STEPS):
        slots = [18 + 2 * i, 19 + 2 * i]
        out.append(
            dict(
                input_ids=[20 + i, 40 + i],
                req_rows=[0, 2],
                q_lens=[1, 1],
                kv_lens=[10 + i, 4 + i],
                out_slots=slots,
                logits_indices=[0, 1],
            )
        )
    for i in range(NUM_ONE_ROW_STEPS):
        out.append(
            dict(
                input_ids=[60 + i],
                req_rows=[0],
                q_lens=[1],
                kv_lens=[10 + NUM_DECODE_STEPS + i],
                out_slots=[18 + 2 * NUM_DECODE_STEPS + i],
                logits_indices=[0],
            )
        )
    return out


def runner(folder: str, tp: TensorParallel, device: str, dtype: str) -> ModelRunner:
    cfg = RunnerConfig(
        model_id=folder,
        device=device,
        dtype=dtype,
        num_kv_slots=256,
        max_rows=4,
        cuda_graph_batch_sizes=[1, 2, 4],
        show_progress=False,
    )
    return ModelRunner(cfg, tp=tp)


def run_steps(model: ModelRunner) -> list[torch.Tensor]:
    if model.is_pooling:  # whole prompts in one flat step, then one alone
        return [pooled.cpu() for pooled in pool_steps(model)]
    if model.cross_attention is not None:  # Mllama: its logits steps (rank 0's image keys, last, hold its heads only)
        return image_steps(model, greedy=False)[:-1]
    outputs = []
    for step in steps():
        step = dict(step, input_ids=[i % model.vocab_size for i in step["input_ids"]])
        outputs.append(model.forward(build_forward_batch(device=model.device, **step)).cpu().clone())
    return outputs


def rank_main(rank: int, port: int, folders: dict[str, str], dtype: str, started: float) -> None:
    """Each family at 2 ranks; rank 0 checks it against the one-GPU reference saved beside its checkpoint and
    prints the verdict at once (a run cut short still tells what it checked)."""
    tp = init_tensor_parallel(rank, 2, "127.0.0.1", port, torch.device("cuda", rank))
    for family, folder in folders.items():
        model = runner(folder, tp, f"cuda:{rank}", dtype)
        broadcast = StepBroadcast(tp)
        if rank == 0:
            model.step_sender = broadcast
            sharded = run_steps(model)
            broadcast.send_stop()
            reference = torch.load(f"{folder}/reference.pt")
            errors = [max_rel_error(ours.float(), ref.float()) for ours, ref in zip(sharded, reference, strict=True)]
            ok = max(errors) <= TOLERANCE[dtype]
            Path(folder, "verdict").write_text("ok" if ok else "MISS")
            print(
                f"{family:14s} {dtype} TP=2 vs TP=1: max rel error {max(errors):.2e} over {len(errors)} steps "
                f"{'ok' if ok else 'MISS'} ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
        else:
            model.follow_rank_zero(broadcast)
        torch.cuda.synchronize()
        del model
        torch.cuda.empty_cache()
    exit_process(0)  # not destroy_process_group, which blocked both ranks here once they had run two families


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    families = sorted(TINY_FAMILIES) + [f"pool-{name}" for name in POOLING_MODELS]
    families += [f"fallback-{name}" for name in FALLBACK_MODELS] + ["fallback-mllama"]
    parser.add_argument("--families", nargs="+", choices=families, default=families)
    args = parser.parse_args()
    dtype = args.dtype
    assert torch.cuda.device_count() >= 2, "needs 2 GPUs"
    started = time.perf_counter()
    work = tempfile.mkdtemp(prefix="tp-families-")
    folders = {}
    for family in args.families:  # the one-GPU references first, each saved beside its checkpoint
        folders[family] = folder = f"{work}/{family}"
        if family.startswith("pool-"):
            POOLING_MODELS[family.removeprefix("pool-")](folder, {**SIZES, "vocab_size": 251})
        elif family == "fallback-mllama":
            saved_mllama(folder)
        elif family.startswith("fallback-"):
            FALLBACK_MODELS[family.removeprefix("fallback-")](folder, {**SIZES, "vocab_size": 251})
        else:
            config_cls, overrides = TINY_FAMILIES[family]
            head_dim = {"head_dim": 32} if "head_dim" in overrides else {}  # the CPU cases' 16: below Triton's minimum
            tiny_hf_model(config_cls, **{**SIZES, **overrides, **head_dim}).save_pretrained(folder)
        model = runner(folder, NO_TP, "cuda:0", dtype)
        torch.save(run_steps(model), f"{folder}/reference.pt")
        del model
        torch.cuda.empty_cache()
        print(f"{family:14s} {dtype} one GPU done ({time.perf_counter() - started:.0f} s)", flush=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(rank_main, args=(port, folders, dtype, started), nprocs=2, start_method="spawn")
    verdicts = [Path(folder, "verdict") for folder in folders.values()]  # none: rank 0 stopped before it
    return 0 if all(v.exists() and v.read_text() == "ok" for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
