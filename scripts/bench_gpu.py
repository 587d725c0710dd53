"""Decode benchmark for a GPU: the fused loop against the unfused loop, autoregressive decoding and HF `generate`.

    python scripts/bench_gpu.py --device cuda                       # what scripts/gpu_check.sh runs (< 8 minutes)
    python scripts/bench_gpu.py --device cpu --dry-run              # tiny shapes: everything up to the CUDA calls

Verifiers: the embedded one (`--embedded`, a built folder such as `$DRAFTHEADS_HOME/tiny-micro` or the code-100m
build of `gpu_check.sh --realistic`; skipped when absent) and a randomly initialised Llama-shaped ~1B one (hidden
2048, 16 layers, 32 heads / 8 KV heads, MLP 5632, vocab 32000, bf16; `--init-std` makes its next-token distributions
peaked, so greedy continuations are stable).

Drafter: EAGLE (`--eagle-version`, a chain of `--chain` tokens), built from models/eagle/ and briefly fitted
(`--fit-steps` AdamW steps of its own training loss) on the verifier's greedy continuations of prompts
(self-distillation): random ids, or with `--fit-data stdlib` windows of the stdlib's `drafter` split (an embedded
verifier never trained on them). Timed prompts: four fixed code prompts, or with `--prompt-source stdlib` windows of
the held-out `eval` split. Random weights would accept almost nothing; tau is measured from the decode stats, never
assumed. Where this build's engine has no `eagle` method yet, a draft model stands in (reported as such).

Per verifier:
  1. exactness, float32 verifier: greedy tokens of the fused loop (CUDA graphs + Triton kernels), the unfused loop,
     autoregressive decoding (fused and unfused) and HF generate are identical, token for token;
  2. timing, bf16: ms per token (batch 1, EOS off, fixed new tokens) of HF generate, autoregressive unfused/fused,
     EAGLE unfused/fused; tau; speedup over autoregressive in the same fused runtime; efficiency = speedup / tau;
     fused/unfused ratios; whether the bf16 outputs agree too (near-ties may flip between kernel shapes in bf16).
Writes `<out>/gpu-<date>-<gpu>.json` and `.md` (date, hardware, versions, every number) and prints a table last.
Exit status 1 when a float32 exactness check fails.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch

from draftheads.eval import SpeculativeDecoder  # noqa: E402
from draftheads.eval.drafters import make_drafter  # noqa: E402
from draftheads.eval.engine.cuda_loop import Buckets, FusedDecoder  # noqa: E402
from draftheads.eval.engine.protocol import NoDrafter  # noqa: E402
from draftheads.models.verifier import Verifier  # noqa: E402

CODE_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def parse_config(path):\n    with open(path) as f:\n",
]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- verifiers ---------------------------------------------------------------------------------------------------
def llama_1b(device, dry_run: bool, init_std: float, seed: int = 0) -> Verifier:
    """A random Llama-shaped verifier, float32 (cast later). Dry run: the same code at toy size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=300) if dry_run else \
        dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=5632, vocab_size=32000)
    config = LlamaConfig(**shape, max_position_embeddings=4096, initializer_range=init_std, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    name = "random-llama-1b" if not dry_run else "random-llama-toy"
    return Verifier(model.eval(), name=name, fingerprint=f"random-{seed}-{init_std}")


def embedded(path: str | None, device) -> tuple[Verifier | None, object, str]:
    """The embedded verifier from a built folder (never built here: that is gpu_check.sh's job, under a timeout)."""
    if not path or path == "none":
        return None, None, "no embedded verifier given (--embedded)"
    folder = Path(path)
    if not (folder / "config.json").exists():
        return None, None, f"embedded verifier folder {folder} has no config.json (not built or not carried)"
    verifier = Verifier.from_pretrained(str(folder), dtype=torch.float32, device=device)
    tokenizer = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # prompts fall back to random token ids
        log(f"embedded tokenizer not loaded ({e}); random prompts")
    return verifier, tokenizer, f"embedded verifier {folder}"


def stdlib_prompts(tokenizer, split: str, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` tokens cut from the stdlib's `split` files (draftheads.data.stdlib): the files in a
    seeded order, taken round after round (several windows a file when n is larger than the split), each window
    from a seeded random place in its file."""
    from draftheads.data.stdlib import read_source, stdlib_files

    gen = torch.Generator().manual_seed(seed)
    files = stdlib_files(split)
    order = torch.randperm(len(files), generator=gen).tolist()
    ids: dict[int, list[int]] = {}  # file index -> its tokens, read once
    out: list[list[int]] = []
    for i in range(4 * max(n, len(order))):
        if len(out) == n:
            break
        f = order[i % len(order)]
        if f not in ids:  # the backend's encode: no max-length warning for a long file
            ids[f] = tokenizer.backend_tokenizer.encode(read_source(files[f]), add_special_tokens=False).ids
        if len(ids[f]) >= length:
            start = int(torch.randint(0, len(ids[f]) - length + 1, (1,), generator=gen))
            out.append(ids[f][start: start + length])
    if len(out) < n:
        raise ValueError(f"the stdlib's {split!r} split has too few files of {length}+ tokens for {n} prompts")
    return out


def prompts_for(verifier: Verifier, tokenizer, n: int, length: int, seed: int, source: str = "code"
                ) -> list[list[int]]:
    """Prompts of token ids: the fixed code prompts (`code`), windows of the stdlib's held-out `eval` split
    (`stdlib`; a verifier with a tokenizer), or random ids (no tokenizer)."""
    if tokenizer is not None and source == "stdlib":
        return stdlib_prompts(tokenizer, "eval", n, length, seed)
    if tokenizer is not None:
        return [tokenizer.encode(p)[:length] for p in (CODE_PROMPTS * n)[:n]]
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, verifier.vocab_size, (n, length), generator=gen).tolist()


# ---- the drafter ---------------------------------------------------------------------------------------------------
def fit_eagle(verifier: Verifier, args, device, tokenizer=None) -> tuple[torch.nn.Module, dict]:
    """An EAGLE drafter from models/eagle/, briefly fitted on the verifier's own greedy continuations of prompts:
    random ids, or (`--fit-data stdlib`, a verifier with a tokenizer) windows of the stdlib's `drafter` split,
    which the embedded verifiers never trained on."""
    from draftheads.models.eagle import EagleConfig, build_drafter, count_tokens

    t0 = time.perf_counter()
    n, plen = (8, 8) if args.dry_run else (args.fit_sequences, 16)
    seq = 32 if args.dry_run else args.fit_seq_len
    stdlib = args.fit_data == "stdlib" and tokenizer is not None
    prompts = (stdlib_prompts(tokenizer, "drafter", n, plen, seed=123) if stdlib
               else prompts_for(verifier, None, n, plen, seed=123))
    ar = FusedDecoder(SpeculativeDecoder(verifier, NoDrafter(), "autoregressive"), buckets=Buckets(batch=(n,)))
    cont = ar.generate(prompts, seq - plen, eos_token_id=None).output_ids
    ids = torch.tensor([p + c for p, c in zip(prompts, cont)], device=device)  # (n, seq)
    mask = torch.ones_like(ids)
    cfg = EagleConfig(version=args.eagle_version, ttt_steps=3,
                      draft_vocab_size=min(8192, verifier.vocab_size) if args.eagle_version == 3 else None)
    counts = count_tokens(ids, mask, verifier.vocab_size) if args.eagle_version == 3 else None
    drafter = build_drafter(verifier, cfg, counts).train()
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=args.fit_lr)
    gen = torch.Generator(device=device).manual_seed(0)
    batch = min(args.fit_batch, n)
    losses = []
    for step in range(args.fit_steps):
        rows = torch.randint(0, n, (batch,), generator=gen, device=device)
        with torch.no_grad():
            feats = verifier.features(ids[rows], layer_ids=drafter.feature_layers, return_logits=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = drafter.training_loss(ids[rows], feats, mask[rows])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % max(1, args.fit_steps // 5) == 0 or step == args.fit_steps - 1:
            losses.append(round(float(out.loss.detach()), 4))
    drafter = drafter.eval().requires_grad_(False).to(dtype=verifier.dtype if device.type == "cuda" else
                                                       torch.float32)
    return drafter, {"eagle_version": args.eagle_version, "fit_steps": args.fit_steps, "fit_lr": args.fit_lr,
                     "fit_data": "stdlib drafter split" if stdlib else "random prompts",
                     "fit_sequences": n, "fit_seq_len": seq, "fit_batch": batch, "loss_trace": losses,
                     "fit_seconds": round(time.perf_counter() - t0, 2)}


def eagle_method(verifier: Verifier, drafter_module, chain: int, dry_run: bool):
    """make_drafter('eagle', ...) when the engine has it; otherwise a small draft model stands in."""
    try:
        return "eagle", make_drafter("eagle", verifier, drafter_module, chain=chain), "EAGLE chain"
    except NotImplementedError as e:
        from transformers import LlamaForCausalLM

        small = copy.deepcopy(verifier.model.config)
        small.num_hidden_layers = 1
        torch.manual_seed(1)
        with torch.device(verifier.device):
            lm = LlamaForCausalLM(small).to(verifier.dtype).eval()
        note = f"STAND-IN: {e} -> a random 1-layer draft model (chain {chain}) replaces EAGLE"
        return "draft-model", make_drafter("draft-model", verifier, lm, num_draft_tokens=chain), note


# ---- running -------------------------------------------------------------------------------------------------------
def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate(verifier: Verifier, prompt: list[int], max_new: int) -> list[int]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new,
                           eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([prompt], device=verifier.device)
    with torch.inference_mode():
        out = verifier.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return out[0, len(prompt):].tolist()


def runners(verifier: Verifier, drafter_factory, args, device) -> dict:
    """name -> fn(prompt, max_new) -> (tokens, stats or None), plus the fused decoders (for graph counts)."""
    ar = SpeculativeDecoder(verifier, NoDrafter(), "autoregressive")
    method, drafter, note = drafter_factory()
    spec = SpeculativeDecoder(verifier, drafter, method)
    capture = {"auto": None, "yes": True, "no": False}[args.capture_drafter]
    buckets = Buckets(batch=(1,))
    ar_fused = FusedDecoder(ar, buckets=buckets)
    spec_fused = FusedDecoder(spec, buckets=buckets, capture_drafter=capture)

    def ours(decoder):
        def run(prompt, max_new):
            out = decoder.generate([prompt], max_new, eos_token_id=None)
            return out.output_ids[0], out.stats
        return run

    fns = {"hf_generate": lambda p, n: (hf_generate(verifier, p, n), None),
           "autoregressive": ours(ar), "autoregressive_fused": ours(ar_fused),
           "spec": ours(spec), "spec_fused": ours(spec_fused)}
    return {"fns": fns, "method": method, "note": note, "spec_fused": spec_fused, "ar_fused": ar_fused,
            "drafter": drafter.describe()}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def exactness(fns: dict, prompts, max_new: int) -> dict:
    """Greedy tokens of every runner against HF generate, per prompt."""
    ref = {i: fns["hf_generate"](p, max_new)[0] for i, p in enumerate(prompts)}
    report = {}
    for name, fn in fns.items():
        if name == "hf_generate":
            continue
        diverged = {i: first_divergence(fn(p, max_new)[0], ref[i]) for i, p in enumerate(prompts)}
        report[name] = {"identical": all(d is None for d in diverged.values()),
                        "first_divergence": {str(i): d for i, d in diverged.items() if d is not None}}
    return report


def timing(fns: dict, prompts, max_new: int, device, repeats: int) -> tuple[dict, dict]:
    """ms per token per runner (after one warm-up over every prompt: graphs, Triton, cuBLAS), and outputs."""
    results, outputs = {}, {}
    for name, fn in fns.items():
        for p in prompts:  # warm-up: every window bucket these prompts reach is captured here
            fn(p, max_new)
        tokens, seconds, tau_num, tau_den, calls = 0, 0.0, 0, 0, 0
        outs = []
        for _ in range(repeats):
            for p in prompts:
                sync(device)
                t = time.perf_counter()
                out, stats = fn(p, max_new)
                sync(device)
                seconds += time.perf_counter() - t
                tokens += len(out)
                outs.append(out)
                if stats is not None:
                    steps = sum(stats.steps_per_row)
                    tau_num += sum(map(sum, stats.accepted)) + steps
                    tau_den += steps
                    calls += stats.verifier_calls
        outputs[name] = outs
        results[name] = {"ms_per_token": 1e3 * seconds / tokens, "tokens_per_s": tokens / seconds,
                         "tokens": tokens, "seconds": seconds,
                         "tau": tau_num / tau_den if tau_den else None, "verifier_calls": calls or None}
        log(f"  {name:22s} {results[name]['ms_per_token']:8.3f} ms/token"
            + (f"  tau {results[name]['tau']:.2f}" if results[name]["tau"] else ""))
    return results, outputs


def derived(t: dict) -> dict:
    ms = {k: v["ms_per_token"] for k, v in t.items()}
    tau = t["spec_fused"]["tau"]
    out = {"tau": tau,
           "speedup_fused_vs_autoregressive_fused": ms["autoregressive_fused"] / ms["spec_fused"],
           "speedup_unfused_vs_autoregressive_unfused": ms["autoregressive"] / ms["spec"],
           "speedup_fused_vs_hf_generate": ms["hf_generate"] / ms["spec_fused"],
           "fused_over_unfused_spec": ms["spec"] / ms["spec_fused"],
           "fused_over_unfused_autoregressive": ms["autoregressive"] / ms["autoregressive_fused"]}
    out["efficiency_fused"] = out["speedup_fused_vs_autoregressive_fused"] / tau
    out["efficiency_unfused"] = out["speedup_unfused_vs_autoregressive_unfused"] / tau
    return out


def bench_verifier(name: str, verifier: Verifier, tokenizer, args, device, deadline: float) -> dict:
    res: dict = {"verifier": {"name": verifier.name, "hidden_size": verifier.hidden_size,
                              "num_layers": verifier.num_layers, "vocab_size": verifier.vocab_size,
                              "parameters": sum(p.numel() for p in verifier.model.parameters())}}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    verifier.model.to(dtype)
    log(f"{name}: fitting the EAGLE drafter ({args.fit_steps} steps)")
    drafter, fit = fit_eagle(verifier, args, device, tokenizer)
    res["fit"] = fit
    factory = lambda: eagle_method(verifier, drafter, args.chain, args.dry_run)  # noqa: E731
    check_prompts = prompts_for(verifier, tokenizer, 2, args.prompt_len, seed=7, source=args.prompt_source)
    if time.perf_counter() < deadline:
        log(f"{name}: float32 exactness ({len(check_prompts)} prompts x {args.check_tokens} tokens)")
        verifier.model.float()  # bf16 -> fp32 is exact, and back again
        r = runners(verifier, factory, args, device)
        res["exactness_fp32"] = exactness(r["fns"], check_prompts, args.check_tokens)
        res["method"], res["method_note"], res["drafter"] = r["method"], r["note"], r["drafter"]
        del r
        verifier.model.to(dtype)
    if time.perf_counter() < deadline:
        log(f"{name}: timing in {dtype} ({args.prompts} prompts x {args.max_new_tokens} tokens, "
            f"{args.repeats} repeat(s))")
        r = runners(verifier, factory, args, device)
        prompts = prompts_for(verifier, tokenizer, args.prompts, args.prompt_len, seed=11, source=args.prompt_source)
        times, outs = timing(r["fns"], prompts, args.max_new_tokens, device, args.repeats)
        res["timing"] = times
        res["derived"] = derived(times)
        res["drafter_captured"] = r["spec_fused"].capture_drafter
        res["graphs_captured"] = {"spec_fused": r["spec_fused"].graphs.captures,
                                  "autoregressive_fused": r["ar_fused"].graphs.captures}
        res["graph_failures"] = {k: {str(key): err for key, err in r[k].graphs.failures.items()}
                                 for k in ("spec_fused", "ar_fused")}
        ref = outs["autoregressive"]
        res["outputs_agree_" + str(dtype).split(".")[-1]] = {
            k: sum(first_divergence(a, b) is None for a, b in zip(v, ref)) / len(ref) for k, v in outs.items()}
        res.setdefault("method", r["method"])
        res.setdefault("method_note", r["note"])
    else:
        res["skipped"] = "time budget spent"
    return res


# ---- report --------------------------------------------------------------------------------------------------------
def hardware(device) -> dict:
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": str(device)}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sm_count=p.multi_processor_count,
                    capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda)
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def markdown(report: dict) -> str:
    hw = report["hardware"]
    lines = [f"# Decode benchmark, {report['date']}", "",
             f"Hardware: {hw.get('gpu', hw.get('cpu'))}; torch {hw['torch']}, triton {hw['triton']}, "
             f"transformers {hw['transformers']}. Batch 1, greedy, EOS off, "
             f"{report['config']['max_new_tokens']} new tokens per prompt. Command: `{report['command']}`.", ""]
    for name, res in report["verifiers"].items():
        lines.append(f"## {name}")
        if "error" in res or "skipped" in res:
            lines += [f"{res.get('error') or res.get('skipped')}", ""]
            continue
        v = res["verifier"]
        lines += [f"{v['name']}: {v['parameters'] / 1e6:.1f}M parameters, hidden {v['hidden_size']}, "
                  f"{v['num_layers']} layers, vocab {v['vocab_size']}. Drafter: {res.get('method_note')}; "
                  f"fit {res['fit']}. Drafter captured in graphs: {res.get('drafter_captured')}; graph captures "
                  f"{res.get('graphs_captured')}, failed captures {res.get('graph_failures')}.", ""]
        if "exactness_fp32" in res:
            ok = {k: v["identical"] for k, v in res["exactness_fp32"].items()}
            lines += [f"float32 greedy tokens identical to HF generate: {ok}", ""]
        if "timing" in res:
            lines += ["| runner | ms/token | tokens/s | tau |", "| --- | ---: | ---: | ---: |"]
            for k, t in res["timing"].items():
                tau = f"{t['tau']:.2f}" if t["tau"] else ""
                lines.append(f"| {k} | {t['ms_per_token']:.3f} | {t['tokens_per_s']:.1f} | {tau} |")
            d = res["derived"]
            lines += ["", f"tau {d['tau']:.2f}; speedup (fused, vs fused autoregressive) "
                          f"{d['speedup_fused_vs_autoregressive_fused']:.2f}x; **efficiency = speedup / tau = "
                          f"{d['efficiency_fused']:.2f}** (unfused: {d['efficiency_unfused']:.2f}); fused/unfused "
                          f"{d['fused_over_unfused_spec']:.2f}x (autoregressive "
                          f"{d['fused_over_unfused_autoregressive']:.2f}x); vs HF generate "
                          f"{d['speedup_fused_vs_hf_generate']:.2f}x.", ""]
    if report["notes"]:
        lines += ["## Notes", *[f"- {n}" for n in report["notes"]], ""]
    return "\n".join(lines)


def summary_table(report: dict) -> str:
    rows = ["verifier            tau   eff(fused)  eff(unfused)  fused/unfused  vs-HF   fp32-exact"]
    for name, res in report["verifiers"].items():
        d = res.get("derived")
        exact = all(v["identical"] for v in res.get("exactness_fp32", {}).values()) \
            if "exactness_fp32" in res else None
        if d is None:
            rows.append(f"{name:18s}  (no timing: {res.get('error') or res.get('skipped')})")
            continue
        rows.append(f"{name:18s} {d['tau']:5.2f}  {d['efficiency_fused']:9.2f}  {d['efficiency_unfused']:11.2f}"
                    f"  {d['fused_over_unfused_spec']:12.2f}x  {d['speedup_fused_vs_hf_generate']:5.2f}x  {exact}")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="toy shapes and counts (CPU smoke test)")
    ap.add_argument("--out", default=None, help="report folder (default docs/benchmarks; dry run: runs/bench)")
    ap.add_argument("--embedded", default=None, help="built embedded verifier folder, or 'none'")
    ap.add_argument("--skip-1b", action="store_true")
    ap.add_argument("--init-std", type=float, default=0.05)
    ap.add_argument("--eagle-version", type=int, default=3, choices=(1, 3))
    ap.add_argument("--chain", type=int, default=4)
    ap.add_argument("--fit-steps", type=int, default=300)
    ap.add_argument("--fit-lr", type=float, default=1e-3)
    ap.add_argument("--fit-sequences", type=int, default=48, help="self-distilled rows the drafter is fitted on")
    ap.add_argument("--fit-seq-len", type=int, default=160, help="tokens a row (16 of prompt, the rest generated)")
    ap.add_argument("--fit-batch", type=int, default=8, help="rows a fitting step")
    ap.add_argument("--fit-data", default="random", choices=("random", "stdlib"),
                    help="the rows' prompts: random ids, or windows of the stdlib's drafter split (needs a tokenizer)")
    ap.add_argument("--prompt-source", default="code", choices=("code", "stdlib"),
                    help="timed prompts: the four fixed code prompts, or windows of the stdlib's held-out eval split")
    ap.add_argument("--capture-drafter", default="auto", choices=("auto", "yes", "no"))
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--check-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting new work after this many seconds")
    args = ap.parse_args(argv)
    for flag in ("fit_sequences", "fit_batch", "prompts", "prompt_len"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected a positive integer")
    if args.fit_seq_len <= 16:
        ap.error(f"--fit-seq-len {args.fit_seq_len}: expected more than the 16 prompt tokens")
    if args.dry_run:
        args.fit_steps, args.prompts, args.prompt_len = min(args.fit_steps, 5), 1, 8
        args.max_new_tokens, args.check_tokens = min(args.max_new_tokens, 12), min(args.check_tokens, 8)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("no CUDA device visible; use --device cpu --dry-run for a smoke test")
        return 2
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    out_dir = Path(args.out or ("runs/bench" if args.dry_run else "docs/benchmarks"))
    now = dt.datetime.now(dt.timezone.utc)
    report = {"date": now.isoformat(timespec="seconds"), "hardware": hardware(device),
              "command": " ".join(["python scripts/bench_gpu.py", *(argv if argv is not None else sys.argv[1:])]),
              "config": vars(args), "verifiers": {}, "notes": []}
    log(f"hardware: {report['hardware']}")

    todo = []
    verifier, tokenizer, note = embedded(args.embedded, device)
    if verifier is None:
        report["notes"].append(f"embedded verifier skipped: {note}")
    else:
        todo.append(("embedded", lambda v=verifier: v, tokenizer))
    if not args.skip_1b:
        todo.append(("llama-1b" if not args.dry_run else "llama-toy",
                     lambda: llama_1b(device, args.dry_run, args.init_std), None))
    failed = False
    for name, build, tok in todo:
        if time.perf_counter() > deadline:
            report["verifiers"][name] = {"skipped": "time budget spent before it started"}
            continue
        try:
            res = bench_verifier(name, build(), tok, args, device, deadline)
        except Exception as e:  # one verifier's failure must not lose the others' numbers
            import traceback

            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}"}
            failed = True
        report["verifiers"][name] = res
        if "method_note" in res and res["method_note"].startswith("STAND-IN"):
            report["notes"].append(f"{name}: {res['method_note']}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        exact = res.get("exactness_fp32", {})
        failed |= not all(v["identical"] for v in exact.values())
    report["seconds"] = round(time.perf_counter() - t_start, 1)

    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", report["hardware"].get("gpu", "cpu")).strip("-").lower()
    stem = out_dir / f"gpu-{now.strftime('%Y%m%d-%H%M')}-{slug}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    log(f"wrote {stem}.json and {stem}.md in {report['seconds']}s")
    print(summary_table(report))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
