"""What an offline run (`features: offline`) holds of the verifier, at a real model's shapes.

    PYTHONPATH=. python scripts/offline_verifier_memory.py --model llama3-8b
    PYTHONPATH=. python scripts/offline_verifier_memory.py --model qwen3-8b --layers 2

Writes a random-weight stand-in with the model's hidden size, heads, intermediate size and vocabulary but only
`--layers` decoder layers (bf16, three safetensors shards with an index, as hub checkpoints are) to a temporary
folder, in a child process, then loads it as the trainers do for offline features (`Verifier.load_head`, what
`train.placement.load_verifier` calls) and prints the bytes the verifier holds, this process's peak RSS growth over
the load and one read of every value held, what an EAGLE-3 run on a cache that stores the verifier's argmax holds (the
draft vocabulary's rows of lm_head only), what a GPU holds of it when the token embedding stays in host memory
(`verifier_embedding: auto`; counted from the tensors, as no GPU loads it here) and what the whole verifier with all
its layers would hold (counted on the meta device, never loaded).
Disk: about 3 GB for the stand-in, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

GIB = 1 << 30

#: The shapes of the models the issue measures at (their config.json fields; num_hidden_layers is the real one).
SHAPES = {
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, num_hidden_layers=32, tie_word_embeddings=False,
                      rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, num_hidden_layers=36,
                     tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=40960,
                     rms_norm_eps=1e-6),
}


def config(model: str, layers: int | None = None):
    from transformers import AutoConfig

    fields = dict(SHAPES[model])
    model_type = fields.pop("model_type")
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return AutoConfig.for_model(model_type, **fields)


def write_stand_in(model: str, layers: int, folder: Path) -> None:
    """Random bf16 weights of `model`'s shapes with `layers` layers, one shard at a time (peak about 1 GiB)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg = config(model, layers)
    cfg.dtype = torch.bfloat16
    cfg.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {name: (p.shape, p.dtype) for name, p in AutoModelForCausalLM.from_config(cfg).named_parameters()}
    groups = [[n for n in shapes if "embed_tokens" in n], [n for n in shapes if n.startswith("lm_head")],
              [n for n in shapes if "embed_tokens" not in n and not n.startswith("lm_head")]]
    weight_map = {}
    generator = torch.Generator().manual_seed(0)
    for i, names in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: (torch.randn(shapes[n][0], generator=generator) * 0.02).to(torch.bfloat16) for n in names},
                  folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers in the stand-in (default 2)")
    parser.add_argument("--draft-vocab", type=int, default=32000, help="EAGLE-3's draft vocabulary (default 32000)")
    parser.add_argument("--write", type=Path, help=argparse.SUPPRESS)  # the child process: write and exit
    args = parser.parse_args()
    if not 1 <= args.draft_vocab <= SHAPES[args.model]["vocab_size"]:
        parser.error(f"--draft-vocab {args.draft_vocab}: expected 1..{SHAPES[args.model]['vocab_size']} "
                     f"({args.model}'s vocabulary)")
    if args.write:
        write_stand_in(args.model, args.layers, args.write)
        return

    import torch
    from transformers import AutoModelForCausalLM

    from draftheads.models.verifier import Verifier

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "stand-in"
        folder.mkdir()
        subprocess.run([sys.executable, __file__, "--model", args.model, "--layers", str(args.layers),
                        "--write", str(folder)], check=True)
        on_disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        before = peak_rss()
        verifier = Verifier.load_head(folder, dtype="bfloat16", device="cpu")
        for t in verifier.model.parameters():  # read every value held once: mapped file pages count from now
            if t.device.type != "meta":
                t.sum()
        grown = peak_rss() - before
        held = verifier.held_bytes()
        parts = {"embed_tokens": verifier.embed_tokens.weight, "lm_head": verifier.lm_head.weight,
                 "norm": verifier.norm.weight}
        # EAGLE-3 on a cache that stores the verifier's argmax: its draft vocabulary's rows of lm_head only
        # (`Eagle3Drafter.hold_draft_rows`); which rows does not change the bytes
        verifier.keep_head_rows(torch.randperm(verifier.vocab_size)[:args.draft_vocab].sort().values)
        eagle3 = verifier.held_bytes()
    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(config(args.model), dtype=torch.bfloat16)
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    layers_real = SHAPES[args.model]["num_hidden_layers"]
    print(f"{args.model} shapes, bf16: stand-in with {args.layers} layers, {on_disk / GIB:.2f} GiB on disk")
    print(f"offline run holds {held / GIB:.3f} GiB of the verifier ("
          + ", ".join(f"{k} {tuple(t.shape)} {t.numel() * t.element_size() / GIB:.3f}" for k, t in parts.items())
          + f"); decoder-layer tensors held: "
          f"{sum(1 for n, p in verifier.model.named_parameters() if '.layers.' in n and p.device.type != 'meta')}")
    print(f"peak RSS growth over the load and one read of every held value: {grown / GIB:.3f} GiB")
    print(f"EAGLE-3 on a cache with the verifier's argmax holds {eagle3 / GIB:.3f} GiB (lm_head: its "
          f"{args.draft_vocab} draft rows, {verifier.kept_head_rows.nbytes / GIB:.3f})")
    table = parts["embed_tokens"].numel() * parts["embed_tokens"].element_size()
    print(f"on a GPU (verifier_embedding: auto, the table in host memory) the device holds "
          f"{(held - table) / GIB:.3f} GiB of it, EAGLE-3 with the argmax {(eagle3 - table) / GIB:.3f}")
    print(f"the whole verifier ({layers_real} layers) would hold {whole_bytes / GIB:.2f} GiB")


if __name__ == "__main__":
    main()
