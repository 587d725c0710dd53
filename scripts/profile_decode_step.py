"""Where a decode step's time goes: drafter, verifier, everything else, per method and tree size, on CPU.

    PYTHONPATH=. python scripts/profile_decode_step.py [--threads 1 2] [--new-tokens 64] [--repeats 5] [--configs ...]

Builds a random verifier shaped like the embedded default (Llama, 8 layers, H=256, V=4096, GQA 4/2), a random
one-layer EAGLE-3 drafter (2048-token draft vocabulary) and 4 Medusa heads, decodes one prompt greedily with each
configuration and prints, per step: draft / verify / other milliseconds and the cost relative to one autoregressive
step. Random weights give tau ~ 1; a step's cost depends on acceptance only through the drafter's forward over the
accepted tokens, which `--accept-all` measures at its largest (a perfect drafter). So
  efficiency = t_autoregressive / t_step        (the most speedup / tau a drafter of any quality can reach)
  break-even tau = t_step / t_autoregressive    (below it, speculation is slower than plain decoding)
Numbers are the best of `--repeats` interleaved runs (the machine is shared).
"""

from __future__ import annotations

import argparse

import torch


def build(seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftheads.models.eagle import EagleConfig, build_drafter
    from draftheads.models.medusa import MedusaHeads
    from draftheads.models.verifier import Verifier

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=False, eos_token_id=2, pad_token_id=0, bos_token_id=1)
    verifier = Verifier(LlamaForCausalLM(config).eval().to(dtype))
    counts = torch.randint(0, 1000, (config.vocab_size,))
    drafter = build_drafter(verifier, EagleConfig(version=3, draft_vocab_size=2048), token_counts=counts, dtype=dtype)
    heads = MedusaHeads.from_verifier(verifier, num_heads=4, dtype=dtype)
    return verifier, drafter.eval(), heads


CONFIGS = {
    "autoregressive": dict(method="autoregressive"),
    "eagle chain 2": dict(method="eagle", chain=2),
    "eagle chain 3": dict(method="eagle", chain=3),
    "eagle chain 4": dict(method="eagle", chain=4),
    "eagle chain 5": dict(method="eagle", chain=5),
    "eagle chain 6": dict(method="eagle", chain=6),
    "eagle tree d4 k2 n6": dict(method="eagle", depth=4, top_k=2, total_tokens=6),
    "eagle tree d5 k3 n10": dict(method="eagle", depth=5, top_k=3, total_tokens=10),
    "eagle tree d4 k4 n16": dict(method="eagle", depth=4, top_k=4, total_tokens=16),
    "eagle tree d6 k4 n16": dict(method="eagle", depth=6, top_k=4, total_tokens=16),
    "eagle tree d5 k6 n24": dict(method="eagle", depth=5, top_k=6, total_tokens=24),
    "eagle tree d6 k8 n32": dict(method="eagle", depth=6, top_k=8, total_tokens=32),
    "eagle tree d6 k8 n48": dict(method="eagle", depth=6, top_k=8, total_tokens=48),
    "eagle tree d6 k10 n60": dict(method="eagle", depth=6, top_k=10, total_tokens=60),
    "medusa chain 4": dict(method="medusa", chain=4),
    "medusa tree 16": dict(method="medusa", tree_budget=16),
    "medusa tree 64": dict(method="medusa", tree_budget=64),
}
#: A plausible rank-accuracy table (head k, rank r) to build Medusa trees from (trained heads come with their own).
RANK_ACCURACY = [[0.6, 0.1, 0.05, 0.03, 0.02], [0.4, 0.1, 0.06, 0.04, 0.03], [0.3, 0.1, 0.06, 0.04, 0.03],
                 [0.25, 0.08, 0.05, 0.04, 0.03]]


def decoder(verifier, drafter, heads, options: dict):
    from draftheads.eval import SpeculativeDecoder
    from draftheads.eval.drafters import make_drafter
    from draftheads.models.medusa import build_medusa_tree

    options = dict(options)
    method = options.pop("method")
    draft = {"eagle": drafter, "medusa": heads}.get(method)
    if "tree_budget" in options:  # heads built in memory carry no rank accuracies: build the tree here
        options["paths"] = build_medusa_tree(RANK_ACCURACY, options.pop("tree_budget"))
    return SpeculativeDecoder(verifier, make_drafter(method, verifier, draft, **options), method)


def accept_everything(dec) -> None:
    """Profiling only: every step accepts the deepest draft path (as a perfect drafter would), so the drafter's
    per-step work (its forward over the accepted tokens) is measured at its largest. Outputs are meaningless."""
    from draftheads.eval.engine.acceptance import Acceptance, _path_to

    def accept(draft, out, sampling):
        tree = draft.tree.expand(draft.tokens.shape[0])
        deepest = tree.depth.argmax(-1)  # (B,)
        a = tree.depth.gather(1, deepest[:, None])[:, 0]
        return Acceptance(a, _path_to(tree, deepest, a), out.logits.argmax(-1).gather(1, deepest[:, None])[:, 0])

    dec.accept = accept


def step_times(dec, prompt: list[int], new_tokens: int) -> dict:
    """Per-step milliseconds of one greedy generate call."""
    stats = dec.generate([prompt], new_tokens, eos_token_id=None).stats
    steps = stats.verifier_calls
    return {"draft": 1e3 * stats.time_draft_s / steps, "verify": 1e3 * stats.time_verify_s / steps,
            "other": 1e3 * stats.time_other_s / steps,
            "step": 1e3 * (stats.time_total_s - stats.time_prefill_s) / steps}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--accept-all", action="store_true",
                        help="accept every draft in full (a perfect drafter's step cost; outputs meaningless)")
    args = parser.parse_args(argv)
    verifier, drafter, heads = build(dtype=getattr(torch, args.dtype))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, verifier.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
    names = ["autoregressive"] + [c for c in args.configs if c != "autoregressive"]
    decoders = {name: decoder(verifier, drafter, heads, CONFIGS[name]) for name in names}
    if args.accept_all:
        for dec in decoders.values():
            accept_everything(dec)
    print("| threads | config | draft ms | verify ms | other ms | step ms | x AR step | efficiency |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dec in decoders.values():
            dec.generate([prompt], 8, eos_token_id=None)  # warm-up: allocations, first-call overheads
        # Interleaved repeats (every config once per round), best of each: a shared machine's load then weighs on
        # all configs alike.
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for name, dec in decoders.items():
                r = step_times(dec, prompt, args.new_tokens)
                if name not in best or r["step"] < best[name]["step"]:
                    best[name] = r
        ar = best["autoregressive"]["step"]
        for name in names:
            r = best[name]
            ratio = r["step"] / ar
            print(f"| {threads} | {name} | {r['draft']:.2f} | {r['verify']:.2f} | {r['other']:.2f} | "
                  f"{r['step']:.2f} | {ratio:.2f} | {1 / ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
