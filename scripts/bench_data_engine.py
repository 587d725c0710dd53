"""Tokens per second of the two data stages, vLLM against our Hugging Face path, on the same rows, side by side.

    python scripts/bench_data_engine.py                                 # tiny stand-in, this machine's CPU
    python scripts/bench_data_engine.py --hidden 1024 --layers 8 --rows 64 --batch 32 --dtype bfloat16   # larger

The verifier is a random Llama-architecture stand-in of the given shape (saved to a temporary folder; the data
stages' cost depends on the shapes, not the weights). Both backends see the same prompts and rows:
  regeneration  `--rows` prompts of `--prompt-len` random tokens, `--max-new` new tokens each at T = 0, no stop
                token (every row generates the same count): HF `generate` in static batches of `--batch` with left
                padding (train/regenerate.generate_batch) against vLLM taking all of them at once (continuous
                batching, train/vllm_backend.VllmGenerator)
  capture       `--rows` rows of `--seq-len` tokens, EAGLE-3's three layers plus the final state, fp32 features:
                the HF forward in micro-batches of `--batch` (train/dump_features._run_verifier) against vLLM's
                extract_hidden_states (train/vllm_backend.VllmFeatures, files read back and assembled)
Times exclude loading and vLLM's start (reported on its own); each stage runs once after a small warm-up.
vLLM runs in .venv-vllm (bash scripts/setup_vllm.sh) with vllm_data_runner.py's CPU settings.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def stand_in(folder: Path, hidden: int, layers: int, vocab: int, seed: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=max(4, hidden // 64),
                         num_key_value_heads=max(2, hidden // 256), max_position_embeddings=4096,
                         tie_word_embeddings=False, initializer_range=0.1)
    LlamaForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    return folder


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--batch", type=int, default=32, help="HF batch (regeneration) and micro-batch (capture)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads of the HF path (default: torch's)")
    p.add_argument("--skip", choices=["regenerate", "capture"], action="append", default=[])
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from draftheads.eval.interop.vllm_data import VllmEngine
    from draftheads.models.verifier import Verifier
    from draftheads.train.dump_features import _run_verifier
    from draftheads.train.regenerate import generate_batch
    from draftheads.train.vllm_backend import VllmFeatures, VllmGenerator, aux_ids

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-data-engine-") as tmp:
        folder = stand_in(Path(tmp) / "verifier", args.hidden, args.layers, args.vocab, 0)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        shape = f"H={args.hidden}, L={args.layers}, V={args.vocab}, {args.dtype}"

        if "regenerate" not in args.skip:
            prompts = torch.randint(3, args.vocab, (args.rows, args.prompt_len), generator=gen).tolist()
            tokens = args.rows * args.max_new
            generate_batch(model, prompts[:2], [], 0, 4, 0.0)  # warm-up

            def hf():
                out = []
                for i in range(0, len(prompts), args.batch):
                    out += generate_batch(model, prompts[i:i + args.batch], [], 0, args.max_new, 0.0)
                return out

            hf_out, hf_s = timed(hf)
            with VllmGenerator.start(folder, args.dtype, max_model_len=args.prompt_len + args.max_new + 8) as vllm:
                start_s = vllm.engine.start_s
                vllm.generate_ids(prompts[:2], [], 4, 0.0)  # warm-up
                vllm_out, vllm_s = timed(lambda: vllm.generate_ids(prompts, [], args.max_new, 0.0))
            assert all(len(o) == args.max_new for o in hf_out + vllm_out)
            same = sum(a == b for a, b in zip(hf_out, vllm_out)) / len(prompts)
            results.append(("regeneration", f"{args.rows} x ({args.prompt_len} + {args.max_new}), HF batch "
                            f"{args.batch}", tokens / hf_s, tokens / vllm_s, start_s, f"{same:.0%} rows equal"))

        if "capture" not in args.skip:
            verifier = Verifier.from_pretrained(folder, dtype=dtype)
            layer_ids = verifier.default_eagle3_layers()
            ids = torch.randint(3, args.vocab, (args.rows, args.seq_len), generator=gen)
            rows = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
                    "position_ids": torch.arange(args.seq_len).expand(args.rows, -1).contiguous()}
            tokens = args.rows * args.seq_len
            small = {k: v[:2] for k, v in rows.items()}
            _run_verifier(verifier, small, layer_ids, torch.float32, args.batch)  # warm-up
            hf_out, hf_s = timed(lambda: _run_verifier(verifier, rows, layer_ids, torch.float32, args.batch))
            storage = Path(tmp) / "states"
            with VllmEngine(folder, dtype=args.dtype, max_model_len=args.seq_len + 1, storage=storage,
                            capture_layers=aux_ids(layer_ids, verifier.num_layers)) as engine:
                start_s = engine.start_s
                features = VllmFeatures(engine, verifier, layer_ids, torch.float32)
                features(small)  # warm-up
                vllm_out, vllm_s = timed(lambda: features(rows))
            err = max(float((hf_out[k] - vllm_out[k]).abs().max() / hf_out[k].abs().max())
                      for k in ("final", "layers"))
            results.append(("capture", f"{args.rows} x {args.seq_len}, layers {layer_ids} + final, HF micro-batch "
                            f"{args.batch}", tokens / hf_s, tokens / vllm_s, start_s, f"max rel. error {err:.1e}"))

    print(f"\nstand-in {shape}; torch threads {torch.get_num_threads()}\n")
    print("| stage | work | HF tokens/s | vLLM tokens/s | vLLM / HF | vLLM start s | check |")
    print("|---|---|---:|---:|---:|---:|---|")
    for stage, work, hf_tps, vllm_tps, start_s, check in results:
        print(f"| {stage} | {work} | {hf_tps:.0f} | {vllm_tps:.0f} | {vllm_tps / hf_tps:.2f}x | {start_s:.0f} | "
              f"{check} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
