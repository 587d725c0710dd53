"""What a drafter's training step keeps for its backward: the bytes of the distinct tensors autograd saves, with and
without activation checkpointing (`eagle.checkpoint_layers`, `dflash.checkpoint_layers`), and for one TTT attention
call, the (T, T) autograd attention against `ttt_attention`'s kernels.

    python scripts/saved_activations.py --hidden 1024 --seq 2048 --ttt 7

Random weights and random verifier features (no verifier forward), batch 1, fp32 (with `--autocast`: bf16 autocast,
as the trainers run, each drafter row twice: the plain modules and models/lean_layer.py's), on this CPU: a Llama-
shaped stand-in of `--hidden` width (hidden/64 heads, a quarter as many kv heads, MLP 2.75x hidden, vocabulary
`--vocab`, the EAGLE-3 draft vocabulary the whole of it). Kept bytes count each storage once: what
torch.autograd.graph.saved_tensors_hooks reports, plus the inputs a checkpointed layer holds for its rerun. Seconds
are CPU seconds of one forward + backward. DFlash: `--dflash-layers` layers, block 16, `--anchors` anchors over a
`--dflash-seq` row.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch


_storages: dict[int, int] = {}  # data pointer -> bytes of the storages kept during one `saved_bytes`


def _keep(x: torch.Tensor) -> torch.Tensor:
    _storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    return x


def saved_bytes(fn) -> tuple[int, float]:
    """(bytes kept for the backward of fn(), CPU seconds of fn() and its backward): what autograd saves, plus the
    tensor inputs that each checkpointed region holds for its rerun."""
    _storages.clear()
    start = time.process_time()
    with torch.autograd.graph.saved_tensors_hooks(_keep, lambda x: x):
        out = fn()
    kept = sum(_storages.values())
    out.backward()
    return kept, time.process_time() - start


def _counting_checkpoint(function, *args, **kwargs):
    """torch.utils.checkpoint.checkpoint, counting the tensors it holds (its arguments, in tuples too)."""
    for arg in args:
        for x in arg if isinstance(arg, tuple) else (arg,):
            if isinstance(x, torch.Tensor):
                _keep(x)
    return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)


def stand_in(hidden: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftheads.models.verifier import Verifier

    heads = hidden // 64
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=4, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                         max_position_embeddings=1 << 16, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2)
    with torch.device("meta"):  # the verifier's layers are never run: only its embedding and lm_head are read
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    torch.nn.init.normal_(model.model.embed_tokens.weight, std=0.02)
    torch.nn.init.normal_(model.lm_head.weight, std=0.02)
    torch.nn.init.ones_(model.model.norm.weight)
    return Verifier(model.eval())


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def autocast(args):
    """bf16 autocast with --autocast (the trainers' mixed precision), else nothing."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast)


def maybe_plain(lean: bool):
    """The plain modules (models/lean_layer.py's `plain_modules`) unless `lean`."""
    from contextlib import nullcontext

    from draftheads.models.lean_layer import plain_modules

    return nullcontext() if lean else plain_modules()


def modules(args, lean: bool) -> str:
    return (", lean layer" if lean else ", plain modules") if args.autocast else ""


def eagle_rows(verifier, args):
    from draftheads.models.eagle import EagleConfig, build_drafter

    torch.manual_seed(0)
    drafter = build_drafter(verifier, EagleConfig(version=3, ttt_steps=args.ttt, draft_vocab_size=None,
                                                  layer_ids=[0, 1, 2])).train()
    T, H = args.seq, verifier.hidden_size
    ids = torch.randint(3, verifier.vocab_size, (1, T))
    feats = SimpleNamespace(layers=[torch.randn(1, T, H) for _ in range(3)], final=None,
                            logits=torch.randn(1, T, verifier.vocab_size))
    mask = torch.ones(1, T, dtype=torch.long)
    for checkpointed in (False, True):
        drafter.cfg.checkpoint_layers = checkpointed
        for lean in (False, True) if args.autocast else (True,):
            with maybe_plain(lean), autocast(args):
                unroll = saved_bytes(lambda: sum(o.float().sum() for o in drafter.ttt_unroll(
                    ids, drafter.project_features(feats.layers))))
                step = saved_bytes(lambda: drafter.training_loss(ids, feats, mask).loss)
            yield (f"EAGLE-3, TTT {args.ttt}, checkpoint_layers={str(checkpointed).lower()}{modules(args, lean)}",
                   unroll, step)


def dflash_rows(verifier, args):
    from draftheads.models.dflash import DFlashConfig, build_drafter, sample_anchors

    torch.manual_seed(0)
    drafter = build_drafter(verifier, DFlashConfig(num_hidden_layers=args.dflash_layers, block_size=16,
                                                   num_anchors=args.anchors)).train()
    T, H = args.dflash_seq, verifier.hidden_size
    ids = torch.randint(3, verifier.vocab_size, (1, T))
    feats = SimpleNamespace(layers=[torch.randn(1, T, H) for _ in drafter.feature_layers], final=None,
                            logits=torch.randn(1, T, verifier.vocab_size))
    mask = torch.ones(1, T, dtype=torch.long)
    anchors = sample_anchors(mask, args.anchors, generator=torch.Generator().manual_seed(0))
    context = torch.cat(feats.layers, -1)
    name = f"DFlash, {args.dflash_layers} layers, {args.anchors} anchors x 16 over {T}"
    drafter.cfg.checkpoint_layers = False
    yield (f"{name}, the dense anchored mask (the reference)",
           saved_bytes(lambda: drafter.anchored_hidden(ids, context, *anchors, attention="dense").sum()), None)
    for checkpointed in (False, True):
        drafter.cfg.checkpoint_layers = checkpointed
        for lean in (False, True) if args.autocast else (True,):
            with maybe_plain(lean), autocast(args):
                layers = saved_bytes(lambda: drafter.anchored_hidden(ids, context, *anchors).float().sum())
                step = saved_bytes(lambda: drafter.training_loss(ids, feats, mask, anchors=anchors).loss)
            yield f"{name}, checkpoint_layers={str(checkpointed).lower()}{modules(args, lean)}", layers, step


def attention_rows(args):
    """One TTT attention call at step 3 of the EAGLE-3 stand-in's shapes, packed rows of 4 documents."""
    from draftheads.data.documents import document_ids
    from draftheads.models.eagle import ttt_attention

    def autograd_over_scores(q, keys, values):  # the causal (T, T) scores beside the chain's, one softmax, autograd
        groups = q.shape[1] // keys[0].shape[1]
        k, v = ([x.repeat_interleave(groups, 1) for x in xs] for xs in (keys, values))
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        prefix = (q @ k[0].transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~causal, -torch.inf)  # (B, nh, T, T)
        own = [(q * kj).sum(-1, keepdim=True) * q.shape[-1] ** -0.5 for kj in k[1:]]
        p = torch.cat([prefix, *own], -1).softmax(-1)
        return p[..., :T] @ v[0] + sum(p[..., T + j, None] * vj for j, vj in enumerate(v[1:]))

    T, heads = args.seq, args.hidden // 64
    g = torch.Generator().manual_seed(0)

    def make(n):
        return torch.randn(1, n, T, 64, generator=g).requires_grad_()

    q, keys, values = make(heads), [make(heads // 4) for _ in range(4)], [make(heads // 4) for _ in range(4)]
    documents = document_ids(torch.arange(T).remainder(T // 4)[None])
    for name, fn in (("autograd over (T, T) scores (the reference; what CUDA ran before)",
                      lambda: autograd_over_scores(q, keys, values).sum()),
                     ("ttt_attention, CPU flash kernel, one document a row",
                      lambda: ttt_attention(q, keys, values).sum()),
                     ("ttt_attention, CPU flash kernel, packed rows (document ids)",
                      lambda: ttt_attention(q, keys, values, documents).sum()),
                     ("ttt_attention, chunked kernel, packed rows",
                      lambda: ttt_attention(q, keys, values, documents, kernel="chunked").sum())):
        yield name, saved_bytes(fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dflash-layers", type=int, default=2)
    parser.add_argument("--dflash-seq", type=int, default=1024)
    parser.add_argument("--anchors", type=int, default=128)
    parser.add_argument("--only", choices=["attention", "eagle", "dflash"], action="append")
    parser.add_argument("--autocast", action="store_true",
                        help="the drafters under bf16 autocast, each row with the plain modules and the lean layer")
    args = parser.parse_args()
    from draftheads.models.dflash import drafter as dflash_drafter
    from draftheads.models.eagle import drafter as eagle_drafter

    eagle_drafter.checkpoint = dflash_drafter.checkpoint = _counting_checkpoint
    only = set(args.only or ["attention", "eagle", "dflash"])
    if "attention" in only:
        print(f"| one TTT attention call (step 3, T {args.seq}, {args.hidden // 64} heads) | kept | CPU s |")
        print("|---|---|---|")
        for name, (kept, seconds) in attention_rows(args):
            print(f"| {name} | {mib(kept)} | {seconds:.2f} |", flush=True)
    verifier = stand_in(args.hidden, args.vocab) if only & {"eagle", "dflash"} else None
    if only & {"eagle", "dflash"}:
        precision = "bf16 autocast" if args.autocast else "fp32"
        print(f"\n| hidden {args.hidden}, vocabulary {args.vocab}, batch 1, {precision} | layers: kept | layers: CPU s "
              f"| whole loss: kept | whole loss: CPU s |")
        print("|---|---|---|---|---|")
    rows = []
    if "eagle" in only:
        rows.append(eagle_rows(verifier, args))
    if "dflash" in only:
        rows.append(dflash_rows(verifier, args))
    for group in rows:
        for name, (layers, layer_s), step in group:
            whole = "| - | - |" if step is None else f"| {mib(step[0])} | {step[1]:.1f} |"
            print(f"| {name} | {mib(layers)} | {layer_s:.1f} {whole}", flush=True)


if __name__ == "__main__":
    main()
