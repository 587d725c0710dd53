"""The peer bench: draftheads, speculators 0.9.0 and SpecForge 0.2.0 train EAGLE-3 drafters on the same rows with
the same token budget and matched settings, all three are served in vLLM (CPU) on HumanEval prompts and decoded in
our engine, and one table says what each delivers. `bash scripts/bench_peers.sh` sets up the environments and
runs this; run by hand:

    python scripts/bench_peers.py --verifier tiny-micro --out runs/peers-tiny-micro [--peers speculators specforge]
        [--rows 400] [--seq-len 256] [--epochs 1] [--batch 4] [--seed 0] [--prompts 16] [--max-new-tokens 64] [-k 3]
        [--optimizer adamw|muon] [--variant LABEL=FLAGS] [--reuse] [--docs docs/peers.md]

In order:
  1. our rows: --rows documents of about --seq-len tokens, pieces of the stdlib `drafter` files in a fixed shuffle
     (`write_docs_jsonl`), written to OUT/docs.jsonl, then tokenised by our data pipeline (one document per row,
     the loss mask ours); every trainer gets exactly these tokens, --epochs times (ours packs the documents into
     rows of --seq-len);
  2. our drafter: `train/eagle.py` with configs/eagle3-tiny.yaml's settings (the verifier's layer ids, draft
     vocabulary, 7 TTT steps, decay 0.8, AdamW unless --optimizer muon), fp32, warm-up 5% then cosine to 0,
     features online (the verifier inside each step) and, a second run, offline from our own feature cache; each
     `--variant LABEL=FLAGS` trains one more online run with those config flags added (e.g.
     `--variant "stream packing=--data.packing=stream"`: the side-by-side of one setting, same rows, steps and seed);
  3. the verifier's features, computed once from those rows, written in each peer's format (speculators:
     `hs_i.safetensors` [T, 4, H] + an Arrow dataset; SpecForge: one `.ckpt` per row) with OUR draft vocabulary map
     (d2t / t2d read back from our export) and our layer ids;
  4. each peer's trainer in its own environment (scripts/setup_peers.sh), through its CPU runner in
     eval/interop/ (patches at run time, each explained there), timed around its training loop;
  5. `draftheads import-peer --fix` on each peer's folder (every fix it needed is listed), then
     `draftheads serve-check` on every folder: vLLM's tau and per-position acceptance, and our engine's counts
     beside vLLM's;
  6. the table on stdout, in OUT/peers.json, and in --docs.

--reuse keeps a trainer's result from an earlier run into the same OUT (OUT/results/NAME.json) when its command,
the documents and the verifier are the same, so a rerun retrains only what changed (speculators' run is the long
one); every folder is served again either way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PEERS = ("speculators", "specforge")
LR, WARMUP, TTT, DECAY = 6e-3, 0.05, 7, 0.8


def say(*args):
    print("[bench_peers]", *args, file=sys.stderr, flush=True)


def run_key(args, out: Path, cmd: list) -> str:
    """What decides a trainer's result: its command, the documents it reads and the verifier's files."""
    h = hashlib.sha256(json.dumps([str(c) for c in cmd]).encode())
    h.update((out / "docs.jsonl").read_bytes())
    for path in sorted(Path(args.verifier_path).glob("*")):
        if path.is_file() and path.suffix in (".json", ".safetensors"):
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def reused(args, out: Path, name: str, key: str) -> dict | None:
    """With --reuse, the result an earlier run recorded for `name` under the same key (and whose folder exists)."""
    path = out / "results" / f"{name}.json"
    if not args.reuse or not path.is_file():
        return None
    result = json.loads(path.read_text())
    if result.get("key") != key or not Path(result["folder"]).is_dir():
        return None
    say(f"{name}: reusing {path} (same command, documents and verifier)")
    return result


def record(out: Path, name: str, key: str, result: dict) -> dict:
    (out / "results").mkdir(exist_ok=True)
    result = {**result, "key": key}
    tmp = out / "results" / f".{name}.json.tmp"
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(out / "results" / f"{name}.json")
    return result


def run(cmd: list[str], log: Path, env: dict | None = None) -> tuple[float, float]:
    """Run a command (output to `log`); (wall seconds, its peak RSS in MiB, from its own rusage). Exits with the
    log's tail when it fails."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = log.read_text().strip().splitlines()[-15:]
        raise SystemExit(f"[bench_peers] {' '.join(map(str, cmd[:4]))} ... failed ({code}); {log}:\n"
                         + "\n".join(tail))
    return seconds, usage.ru_maxrss / 1024


# ---- 1. the rows ---------------------------------------------------------------------------------------------------
HELDOUT_DOCS = 4
MIN_PIECE = 32
"""Documents after the training rows in docs.jsonl: our trainer holds a file source's last rows out for its
held-out evaluation, so the rows it trains on are exactly the others."""


def write_docs_jsonl(tokenizer, rows: int, seq_len: int, batch: int, out: Path) -> Path:
    """The bench's documents: the stdlib `drafter` files cut into consecutive pieces of seq_len - 2 tokens (a file's
    last piece kept when it has at least MIN_PIECE tokens), shuffled with a fixed seed; the first `rows` (less up to
    batch - 1) train and the next HELDOUT_DOCS are held out. Each is written as text, so every trainer reads whole
    documents of at most about seq_len tokens once our pipeline has added its special tokens and EOS (ours packs
    them; the peers take one per row). Pieces rather than files' beginnings: those are mostly licence headers and
    module docstrings, while the drafters are measured on code."""
    import random

    from draftheads.data.stdlib import read_source, stdlib_files

    pieces = []
    for path in stdlib_files("drafter"):
        ids = tokenizer(read_source(path), add_special_tokens=False)["input_ids"]
        pieces += [ids[i: i + seq_len - 2] for i in range(0, len(ids), seq_len - 2)
                   if len(ids) - i >= min(MIN_PIECE, seq_len - 2)]
    random.Random(0).shuffle(pieces)
    training = min(rows, len(pieces) - HELDOUT_DOCS)
    training -= training % batch  # whole optimizer steps of `batch` rows (SpecForge refuses an incomplete one)
    lines = [json.dumps({"text": tokenizer.decode(ids), "origin": f"stdlib-piece-{i}"})
             for i, ids in enumerate(pieces[: training + HELDOUT_DOCS])]
    path = out / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def our_rows(tokenizer, docs: Path, rows: int, seq_len: int) -> list[dict]:
    """[{input_ids, loss_mask}] one document per row, as our pipeline tokenises docs.jsonl (the training rows)."""
    from draftheads.data.batching import build_datasets
    from draftheads.data.config import DataConfig

    train, _ = build_datasets(DataConfig(source=str(docs), seq_len=2 * seq_len, pack=False, strict=True,
                                         eval_rows=HELDOUT_DOCS), tokenizer)
    out = []
    for row in train:
        n = int(row["attention_mask"].sum())
        out.append({"input_ids": row["input_ids"][:n].long(), "loss_mask": row["loss_mask"][:n].long()})
    expected = len(docs.read_text().splitlines()) - HELDOUT_DOCS
    if len(out) != expected:
        raise SystemExit(f"[bench_peers] {docs}: {len(out)} training rows, expected {expected}")
    return out


def drafter_settings(verifier) -> tuple[list[int], int]:
    """(layer ids, draft vocabulary size) every trainer of the bench uses on `verifier`: vLLM's default layers on a
    shallow verifier, else 2, 4 and the last layer's input; half the vocabulary, at most 2048."""
    layer_ids = verifier.default_eagle3_layers() if verifier.num_layers < 8 else [2, 4, verifier.num_layers - 1]
    return layer_ids, min(2048, verifier.vocab_size // 2)


# ---- 3. features in the peers' formats -----------------------------------------------------------------------------
@torch.no_grad()
def row_features(verifier, ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(aux (T, 3, H): the inputs of `layer_ids`; last (T, H): the last layer's output before the final norm;
    final (T, H): after it), one verifier forward."""
    seen = {}
    hook = verifier.norm.register_forward_pre_hook(lambda module, args: seen.setdefault("last", args[0]))
    try:
        feats = verifier.features(ids[None], layer_ids=layer_ids)
    finally:
        hook.remove()
    return torch.stack([x[0] for x in feats.layers], 1), seen["last"][0], feats.final[0]


SPECULATORS_VAL_ROWS = 2
"""speculators holds out the dataset's tail for validation (train_data_ratio < 1 is required): the first rows are
appended again as that tail, so it trains on exactly our rows."""


def dump_speculators(rows, verifier, layer_ids, d2t, t2d, out: Path) -> None:
    """speculators' offline layout: an Arrow dataset (input_ids, loss_mask, seq_len) saved to disk, and
    hidden_states/hs_i.safetensors {hidden_states (T, 4, H): the three layers then the last pre-norm state,
    token_ids (T,)}; the vocabulary maps as d2t-Vd.npy / t2d-Vd.npy."""
    def with_features():  # one row's features at a time: a large verifier's would not fit in memory together
        for row in rows + rows[:SPECULATORS_VAL_ROWS]:
            aux, last, _ = row_features(verifier, row["input_ids"], layer_ids)
            yield {**row, "hidden_states": torch.cat([aux, last[:, None]], 1)}

    write_speculators_data(out, with_features(), d2t, t2d)


def write_speculators_data(out: Path, docs, d2t: torch.Tensor, t2d: torch.Tensor) -> Path:
    """Write `docs` (an iterable of {input_ids (T,), loss_mask (T,), hidden_states (T, 4, H)}) in speculators'
    offline layout under `out`: hidden_states/hs_i.safetensors {hidden_states, token_ids} per document as it comes,
    then the Arrow dataset (input_ids, loss_mask, seq_len) and the maps d2t-Vd.npy / t2d-Vd.npy."""
    import datasets
    import numpy as np
    from safetensors.torch import save_file

    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    columns = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i, doc in enumerate(docs):
        save_file({"hidden_states": doc["hidden_states"].contiguous(), "token_ids": doc["input_ids"].contiguous()},
                  str(out / "hidden_states" / f"hs_{i}.safetensors"))
        columns["input_ids"].append(doc["input_ids"].tolist())
        columns["loss_mask"].append(doc["loss_mask"].tolist())
        columns["seq_len"].append(len(doc["input_ids"]))
    datasets.Dataset.from_dict(columns).with_format("torch").save_to_disk(str(out))
    np.save(out / f"d2t-{d2t.numel()}.npy", d2t.numpy())
    np.save(out / f"t2d-{d2t.numel()}.npy", t2d.numpy())
    return out


def dump_specforge(rows, verifier, layer_ids, d2t, t2d, out: Path) -> None:
    """SpecForge's offline layout: one torch-saved dict per row, {input_ids (T,), loss_mask (T,), hidden_state
    (1, T, H): the final *post*-norm state (its target head is lm_head alone), aux_hidden_state (1, T, 3H)}; the
    vocabulary maps as one torch-saved {d2t, t2d}."""
    (out / "features").mkdir(parents=True, exist_ok=True)
    for i, row in enumerate(rows):
        aux, _, final = row_features(verifier, row["input_ids"], layer_ids)
        torch.save({"input_ids": row["input_ids"], "loss_mask": row["loss_mask"], "hidden_state": final[None],
                    "aux_hidden_state": aux.flatten(1)[None]}, out / "features" / f"data_{i:06d}.ckpt")
    torch.save({"d2t": d2t, "t2d": t2d}, out / "vocab_mapping.pt")


# ---- 2 and 4. the trainers -----------------------------------------------------------------------------------------
def train_ours(args, out: Path, layer_ids, vocab: int, tokens: int, features: str, name: str,
               label: str = "", flags: tuple[str, ...] = ()) -> dict:
    steps = max(1, math.ceil(args.epochs * tokens / (args.batch * args.seq_len)))
    run_dir = out / f"draftheads-{label or features}".replace(" ", "-")
    cmd = [sys.executable, "-m", "draftheads.train.eagle", "--config", str(ROOT / "configs/eagle3-tiny.yaml"),
           f"--verifier={args.verifier}", f"--output_dir={run_dir}", f"--data.source={out / 'docs.jsonl'}",
           f"--data.seq_len={args.seq_len}", f"--data.eval_rows={HELDOUT_DOCS}", f"--train.max_steps={steps}",
           f"--train.batch_size={args.batch}", f"--train.lr={LR}", f"--train.seed={args.seed}",
           f"--train.optimizer={args.optimizer}",
           f"--train.warmup_steps={max(1, round(WARMUP * steps))}",
           "--train.min_lr_ratio=0.0", "--train.mixed_precision=no", "--train.save_every=0", "--train.eval_every=0",
           f"--eagle.layer_ids={json.dumps(layer_ids)}", f"--eagle.draft_vocab_size={vocab}",
           f"--eagle.ttt_steps={TTT}", f"--eagle.decay={DECAY}", "--wandb.enabled=false", "--train.resume=none",
           *flags]
    key = run_key(args, out, cmd + [features])
    if (result := reused(args, out, name, key)) is not None:
        return result
    from draftheads.data.config import DataConfig

    packing = next((f.split("=", 1)[1] for f in reversed(flags) if f.startswith("--data.packing=")),
                   DataConfig.packing)
    if features == "offline":
        cache = out / "draftheads-cache"  # a rerun skips the shards already written
        dump = [sys.executable, "-m", "draftheads.train.dump_features", "--dtype", "float32", "--out", str(cache),
                *cmd[3:]]
        seconds, _ = run(dump, out / "draftheads-dump.log")
        say(f"our feature cache: {seconds:.0f} s")
        cmd += ["--features=offline", f"--feature_cache={cache}"]
    seconds, rss = run(cmd, out / f"draftheads-{features}.log")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [m["train/tokens_per_s"] for m in metrics if "train/tokens_per_s" in m]
    extra = f", {' '.join(flags)}" if flags else ""
    return record(out, name, key, {
        "folder": str(run_dir / "drafter"), "steps": steps, "wall_s": seconds, "peak_rss_mib": rss,
        "tokens_per_s": sum(rates) / len(rates) if rates else None,
        "how": f"features {features}, {steps} steps of {args.batch} x {args.seq_len} tokens packed "
               f"({packing.replace('_', '-')}){extra}"})


def speculators_flags(args, data: Path, layer_ids, vocab: int, save: Path, logs: Path) -> list[str]:
    """speculators' `train` flags for the bench's run (scripts/peer_step_check.py builds its model from them)."""
    per_step = args.batch * args.seq_len
    optimizer = args.optimizer
    return ["--verifier-name-or-path", str(args.verifier_path), "--data-path", str(data),
            "--speculator-type", "eagle3", "--num-layers", "1", "--draft-arch", "llama",
            "--target-layer-ids", *map(str, layer_ids), "--draft-vocab-size", str(vocab),
            "--d2t-path", str(data / f"d2t-{vocab}.npy"), "--t2d-path", str(data / f"t2d-{vocab}.npy"),
            "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output",  # plain EAGLE-3, as ours
            "--sliding-window", str(args.seq_len * 4), "--draft-attn-impl", "sdpa",
            "--loss-implementation", "eager", "--num-workers", "0", "--hidden-states-dtype", "float32",
            "--total-seq-len", str(per_step),
            "--train-data-ratio", str((args.rows + 0.5) / (args.rows + SPECULATORS_VAL_ROWS)), "--ttt-steps", str(TTT),
            "--ttt-step-loss-decay", str(DECAY), "--optimizer", optimizer, "--lr", str(LR), "--weight-decay", "0.0",
            # Muon (speculators' default optimizer) at --lr with AdamW's update size (match_rms_adamw, its default,
            # as ours), no weight decay on its matrices as on ours (its default is 0.1)
            *(["--muon-weight-decay", "0.0"] if optimizer == "muon" else []),
            "--scheduler-type", "cosine", "--scheduler-warmup-ratio", str(WARMUP), "--epochs", str(args.epochs),
            "--save-path", str(save), "--no-resume-from-checkpoint",
            "--log-dir", str(logs), "--seed", str(args.seed)]


def train_speculators(args, out: Path, data: Path, layer_ids, vocab: int, tokens: int, name: str) -> dict:
    python = ROOT / ".venv-speculators/bin/python"
    save = out / "speculators-run"
    report = out / "speculators-report.json"
    per_step = args.batch * args.seq_len
    flags = speculators_flags(args, data, layer_ids, vocab, save, out / "speculators-logs")
    cmd = [str(python), str(ROOT / "eval/interop/speculators_runner.py"), str(report), "--", *flags]
    key = run_key(args, out, cmd)
    if (result := reused(args, out, name, key)) is not None:
        return result
    seconds, rss = run(cmd, out / "speculators.log", env={"CUDA_VISIBLE_DEVICES": ""})
    rep = json.loads(report.read_text())
    last = sorted((p for p in save.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))[-1]
    return record(out, name, key, {
        "folder": str(last), "wall_s": seconds, "peak_rss_mib": rep.get("peak_rss_mib", rss),
        "tokens_per_s": rep["tokens"] / rep["seconds"] if rep.get("seconds") else None, "tokens": rep["tokens"],
        "how": f"features offline (hs_i.safetensors), rows packed into {per_step}-token sequences with document "
               "masks, eager loss, sdpa"})


def train_specforge(args, out: Path, data: Path, layer_ids, vocab: int, tokens: int, verifier, name: str) -> dict:
    import yaml

    from draftheads.models.eagle import EagleConfig
    from draftheads.models.eagle.drafter import Eagle3Drafter
    from draftheads.models.layouts import llama_draft

    python = ROOT / ".venv-specforge/bin/python"
    report, run_dir = out / "specforge-report.json", out / "specforge-run"
    # the draft config, explicit (SpecForge's default draft vocabulary is 32000): our drafter's layer as a Llama
    # config, the capture layers in SGLang's convention (the layer whose output is the feature: ours - 1)
    probe = Eagle3Drafter(verifier, EagleConfig(layer_ids=layer_ids, draft_vocab_size=None, init_from_verifier=False))
    draft = {**llama_draft.config(probe), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": vocab,
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layer_ids]}}
    (out / "specforge-draft.json").write_text(json.dumps(draft, indent=1))
    run_cfg = {"model": {"target_model_path": str(args.verifier_path), "draft_model_config": str(out / "specforge-draft.json"),
                         "vocab_mapping_path": str(data / "vocab_mapping.pt"), "aux_hidden_state_layer_ids":
                         [i - 1 for i in layer_ids], "torch_dtype": "float32"},
               "data": {"hidden_states_path": str(data / "features"), "max_length": args.seq_len},
               "training": {"num_epochs": args.epochs, "batch_size": 1, "accumulation_steps": args.batch,
                            "fsdp_sharding": "NO_SHARD", "learning_rate": LR, "warmup_ratio": WARMUP,
                            "lr_scheduler": "cosine", "ttt_length": TTT, "attention_backend": "sdpa",
                            "log_interval": 10, "seed": args.seed},
               "output_dir": str(run_dir)}
    (out / "specforge-run.yaml").write_text(yaml.safe_dump(run_cfg))
    export = out / "specforge-export"
    cmd = [str(python), str(ROOT / "eval/interop/specforge_runner.py"), str(report), str(out / "specforge-run.yaml"),
           str(out / "specforge-draft.json"), str(export)]
    key = run_key(args, out, cmd + [json.dumps(run_cfg), json.dumps(draft)])
    if (result := reused(args, out, name, key)) is not None:
        return result
    seconds, rss = run(cmd, out / "specforge.log", env={"SPECFORGE_DEVICE": "cpu", "TORCHDYNAMO_DISABLE": "1",
                                                       "CUDA_VISIBLE_DEVICES": ""})
    rep = json.loads(report.read_text())
    trained = args.epochs * tokens  # every row whole (max_length = --seq-len), once per epoch
    return record(out, name, key, {
        "folder": str(export), "wall_s": seconds, "peak_rss_mib": rep.get("peak_rss_mib", rss),
        "tokens_per_s": trained / rep["seconds"] if rep.get("seconds") else None, "tokens": trained,
        "how": f"features offline (.ckpt), one row per micro-batch (padded), {args.batch} accumulated per step, "
               "eager KL loss, sdpa, NO_SHARD, gloo"})


# ---- 5. serve and measure ------------------------------------------------------------------------------------------
def serve(args, verifier, folders: dict[str, str]) -> dict:
    from transformers import AutoTokenizer

    from draftheads.data.prompts import load_prompts, prompt_ids
    from draftheads.eval.interop.serve_check import check

    tokenizer = AutoTokenizer.from_pretrained(verifier.path)
    prompts = [prompt_ids(p, tokenizer) for p in load_prompts("humaneval", args.prompts)]
    reports = check(verifier, list(folders.values()), prompts, args.max_new_tokens, args.k, "float32", "eagle3",
                    say=say)
    out = {}
    for name, report in zip(folders, reports):
        drafts = report.drafts or 0
        out[name] = {"passed": report.passed, "loaded": report.loaded, "findings": report.findings,
                     "unjudged": report.unjudged, "error": report.error, "drafts": drafts,
                     "accepted_per_pos": report.accepted_vllm, "accepted_ours": report.accepted_ours,
                     "tau": 1 + sum(report.accepted_vllm) / drafts if drafts else None,
                     "per_pos": [a / drafts for a in report.accepted_vllm] if drafts else None}
    return out


def import_peer(verifier, folder: str, out: Path) -> tuple[str, list[str], list[str]]:
    """(the fixed folder, the fixes, the notes) from `draftheads import-peer --fix`."""
    from draftheads.eval.interop.peer_folder import findings, fix, inspect

    ins = inspect(folder, verifier)
    fixed = fix(ins, out, verifier)
    return str(fixed), [f.line() for f in findings(ins)], ins.notes


# ---- 6. the table --------------------------------------------------------------------------------------------------
def table(results: dict, k: int) -> str:
    lines = ["| trainer | tau in vLLM | acceptance at k = 1 .. {k} | training tokens/s | how it trained | peak RSS "
             "| its folder as exported, in vLLM | fixes `import-peer --fix` made |".format(k=k),
             "|---|---:|---|---:|---|---:|---|---|"]
    for name, r in results.items():
        s = r.get("served") or {}
        tau = f"{s['tau']:.3f}" if s.get("tau") else "-"
        pos = " / ".join(f"{p:.3f}" for p in s["per_pos"]) if s.get("per_pos") else "-"
        rate = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "-"
        raw = r.get("served_as_exported")
        if raw is None:
            as_exported = "(is the served folder)"
        elif not raw.get("loaded"):
            as_exported = f"refused: {raw.get('error', '')[:80]}"
        else:
            as_exported = f"tau {raw['tau']:.3f}" if raw.get("tau") else "-"
        fixes = "; ".join(f.split(": vLLM reads")[0] for f in r.get("fixes") or []) or "none"
        check = "" if s.get("passed") else " (serve-check: FAIL)"
        lines.append(f"| {name} | {tau}{check} | {pos} | {rate} | {r.get('how', '')} | {r.get('peak_rss_mib', 0):.0f} "
                     f"MiB | {as_exported} | {fixes} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", default="tiny-micro")
    p.add_argument("--out", required=True)
    p.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS)
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=4, help="rows (documents) per optimizer step, for every trainer")
    p.add_argument("--seed", type=int, default=0, help="every trainer's seed")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="ours and speculators': AdamW, or Muon on the drafter's hidden matrices (speculators' default) "
                        "with AdamW for the rest; SpecForge 0.2.0 has AdamW only")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                   help="one more run of ours (features online) with these config flags added, e.g. --variant "
                        "'stream packing=--data.packing=stream' (FLAGS split at spaces); repeatable")
    p.add_argument("--reuse", action="store_true",
                   help="keep a trainer's result from an earlier run into --out when nothing it depends on changed")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--docs", help="also write the table and the settings into this markdown file")
    p.add_argument("--no-offline", action="store_true", help="skip our trainer's offline-feature run")
    args = p.parse_args(argv)
    if args.optimizer != "adamw" and "specforge" in args.peers:
        p.error(f"--optimizer {args.optimizer}: SpecForge 0.2.0 trains with AdamW only; "
                "add --peers speculators to leave it out")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    from draftheads.models.verifier import Verifier, resolve_verifier

    args.verifier_path = resolve_verifier(args.verifier)
    verifier = Verifier.from_pretrained(args.verifier_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(verifier.path)
    layer_ids, vocab = drafter_settings(verifier)
    rows = our_rows(tokenizer, write_docs_jsonl(tokenizer, args.rows, args.seq_len, args.batch, out), args.rows,
                    args.seq_len)
    args.rows = len(rows)  # the stdlib split may hold fewer usable files than asked for
    tokens = sum(len(r["input_ids"]) for r in rows)
    say(f"{len(rows)} rows, {tokens} tokens ({args.epochs} epochs: {args.epochs * tokens}); layer ids {layer_ids}, "
        f"draft vocabulary {vocab}")

    results = {}
    say("draftheads, features online")
    results["draftheads (online)"] = train_ours(args, out, layer_ids, vocab, tokens, "online", "draftheads-online")
    if not args.no_offline:
        say("draftheads, features offline")
        results["draftheads (offline)"] = train_ours(args, out, layer_ids, vocab, tokens, "offline",
                                                     "draftheads-offline")
    for variant in args.variant:
        label, _, flags = variant.partition("=")
        if not label or not flags.startswith("--"):
            raise SystemExit(f"[bench_peers] --variant {variant!r}: expected LABEL=FLAGS, e.g. "
                             "'stream packing=--data.packing=stream'")
        say(f"draftheads, {label}")
        results[f"draftheads, {label}"] = train_ours(args, out, layer_ids, vocab, tokens, "online",
                                                     "draftheads-" + label.replace(" ", "-"), label,
                                                     tuple(flags.split()))
    from safetensors.torch import load_file

    ours = load_file(Path(results["draftheads (online)"]["folder"]) / "model.safetensors")
    d2t, t2d = ours["d2t"], ours["t2d"]  # our draft vocabulary map, handed to the peers
    for peer in args.peers:
        data = out / f"{peer}-data"
        if not (data / ".done").exists():
            say(f"features for {peer}")
            t0 = time.perf_counter()
            (dump_speculators if peer == "speculators" else dump_specforge)(rows, verifier, layer_ids, d2t, t2d, data)
            (data / ".done").write_text(f"{time.perf_counter() - t0:.1f}")
        say(f"{peer} trains")
        if peer == "speculators":
            r = train_speculators(args, out, data, layer_ids, vocab, tokens, peer)
        else:
            r = train_specforge(args, out, data, layer_ids, vocab, tokens, verifier, peer)
        r["raw_folder"] = r["folder"]
        r["folder"], r["fixes"], r["notes"] = import_peer(verifier, r["raw_folder"], out / f"{peer}-fixed")
        results[f"{peer} {'0.9.0' if peer == 'speculators' else '0.2.0'}"] = r

    folders = {name: r["folder"] for name, r in results.items()}
    folders.update({f"{name} as exported": r["raw_folder"] for name, r in results.items() if "raw_folder" in r})
    served = serve(args, verifier, folders)
    for name, r in results.items():
        r["served"] = served[name]
        if "raw_folder" in r:
            r["served_as_exported"] = served[f"{name} as exported"]
    text = table(results, args.k)
    print(text)
    summary = {"verifier": args.verifier, "rows": len(rows), "tokens": tokens, "epochs": args.epochs,
               "batch": args.batch, "seed": args.seed, "seq_len": args.seq_len, "optimizer": args.optimizer,
               "layer_ids": layer_ids, "draft_vocab_size": vocab, "k": args.k, "prompts": args.prompts,
               "max_new_tokens": args.max_new_tokens, "results": results}
    (out / "peers.json").write_text(json.dumps(summary, indent=1, default=str))
    if args.docs:
        write_docs(Path(args.docs), summary, text)
    return 0


def write_docs(path: Path, summary: dict, text: str) -> None:
    """Replace this verifier's section of the page (or add it); a run with another optimizer than AdamW has a
    section of its own."""
    name = summary["verifier"] + (f", {summary['optimizer']}" if summary["optimizer"] != "adamw" else "")
    marker = f"<!-- bench_peers {name} -->"
    section = (f"{marker}\n### {name}\n\n{summary['rows']} rows (documents of at most "
               f"{summary['seq_len']} tokens), {summary['tokens']} tokens, {summary['epochs']} epoch{'s' * (summary['epochs'] != 1)}, "
               f"{summary['batch']} rows per optimizer step, seed {summary['seed']}; layer ids {summary['layer_ids']}, "
               f"draft vocabulary "
               f"{summary['draft_vocab_size']}; {summary['prompts']} HumanEval prompts, {summary['max_new_tokens']} "
               f"new tokens, k = {summary['k']}, T = 0.\n\n{text}\n{marker}\n")
    page = path.read_text() if path.exists() else ""
    if marker in page:
        before, _, rest = page.partition(marker)
        _, _, after = rest.partition(marker + "\n")
        page = before + section + after
    else:
        page = page.rstrip("\n") + "\n\n" + section
    path.write_text(page)


if __name__ == "__main__":
    sys.exit(main())
