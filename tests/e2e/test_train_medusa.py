"""train/medusa.py end to end on a random tiny verifier: outputs, resume equality, Medusa-2, wandb, config errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftheads.models.export import load_medusa, load_medusa_verifier
from draftheads.models.verifier import Verifier
from draftheads.train.config import ConfigError, parse_config
from draftheads.train.medusa import MedusaRunConfig, main
from tests.utils import crash_after_step, reset_accelerate, save_tiny_verifier_with_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls on a busy shared CPU: one thread is ~100x faster than two waiting on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


pytestmark = pytest.mark.usefixtures("fresh_accelerate")


@pytest.fixture(scope="session")
def verifier_dir(tmp_path_factory):
    return save_tiny_verifier_with_tokenizer(tmp_path_factory.mktemp("medusa-verifier") / "v")


def small_args(verifier_dir, output_dir, *extra):
    """A few steps on a few stdlib files at seq_len 32: seconds on a CPU."""
    return ["--verifier", str(verifier_dir), "--output_dir", str(output_dir), "--wandb.enabled=false",
            "--data.seq_len=32", "--data.max_rows=2", "--data.eval_rows=1", "--train.batch_size=2",
            "--train.max_steps=6", "--train.save_every=3", "--train.log_every=1", "--train.eval_every=3",
            "--train.eval_batches=2", "--train.warmup_steps=2", "--train.lr=0.01", "--medusa.num_heads=3",
            "--medusa.tree_budget=8", *extra]


def run(verifier_dir, output_dir, *extra):
    return main(parse_config(MedusaRunConfig, small_args(verifier_dir, output_dir, *extra)))


def records(folder):
    return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


def test_trains_and_writes_run_folder_and_drafter(verifier_dir, tmp_path):
    summary = run(verifier_dir, tmp_path)
    assert (tmp_path / "config.yaml").is_file()
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["medusa"]["num_heads"] == 3 and saved["verifier"] == str(verifier_dir)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000003", "step-000006"]
    logged = records(tmp_path)
    train = [r for r in logged if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert {"train/head0_loss", "train/head2_top1", "train/lr", "train/tokens_per_s"} <= set(train[-1])
    evals = [r for r in logged if "eval/head0_top1" in r]
    assert [r["step"] for r in evals] == [3, 6, 6]  # periodic at 3 and 6, then the final full pass
    assert {f"eval/head{k}_{m}" for k in range(3) for m in ("loss", "top1", "top5")} <= set(evals[-1])

    verifier = Verifier.from_pretrained(verifier_dir)
    heads, meta = load_medusa(tmp_path / "drafter", verifier)
    assert heads.num_heads == 3 and len(meta["tree"]) == 8 and meta["adapter"] is None
    assert len(meta["rank_accuracy"]) == 3 and len(meta["rank_accuracy"][0]) == 10
    assert meta["training"]["steps"] == 6 and meta["training"]["eval"]["head0_top1"] == evals[-1]["eval/head0_top1"]
    assert summary["tree_expected_accepted_length"] > 0
    # the export is the trained heads: they moved away from the verifier's own head
    assert not torch.equal(heads.lm_heads[0].weight, verifier.lm_head.weight)
    # the end-of-run train/serve check: the reloaded export's tau, logged last, equal to the in-memory heads'
    assert logged[-1]["step"] == 6 and logged[-1]["eval/tau"] == logged[-1]["eval/tau_in_memory"] >= 1.0
    assert summary["consistency"]["tau"] == logged[-1]["eval/tau"] and summary["consistency"]["prompts"] == 4


def test_broken_export_fails_the_run(verifier_dir, tmp_path, monkeypatch):
    """An export that drops head 0's weights (written negated) decodes differently: the run raises, naming it."""
    from safetensors.torch import save_file

    from draftheads.train import medusa as train_medusa
    from draftheads.eval.measure.consistency import ConsistencyError

    def save_then_break(folder, *args, **kwargs):
        save_medusa(folder, *args, **kwargs)
        tensors = load_file(Path(folder) / "model.safetensors")
        tensors["lm_heads.0.weight"] = -tensors["lm_heads.0.weight"]
        save_file(tensors, Path(folder) / "model.safetensors", metadata={"format": "pt"})

    save_medusa = train_medusa.save_medusa
    monkeypatch.setattr(train_medusa, "save_medusa", save_then_break)
    with pytest.raises(ConsistencyError, match=r"train/serve check failed: .*drafter: the exported medusa drafter, "
                                               r"reloaded, reaches tau .*first differs at verifier call"):
        run(verifier_dir, tmp_path)
    assert not any("eval/tau" in r for r in records(tmp_path))
    # the check can be switched off (then nothing is measured or logged)
    run(verifier_dir, tmp_path / "unchecked", "--consistency.enabled=false")
    assert not any("eval/tau" in r for r in records(tmp_path / "unchecked"))


def test_interrupted_and_resumed_run_equals_a_straight_run(verifier_dir, tmp_path, monkeypatch):
    """2N steps straight == N steps, a crash one step later, then resume=auto to 2N: same weights, same losses."""
    run(verifier_dir, tmp_path / "straight")
    # after the step-3 checkpoint and one more logged step
    crash_after_step(monkeypatch, 4, lambda: run(verifier_dir, tmp_path / "resumed"))
    reset_accelerate()
    run(verifier_dir, tmp_path / "resumed")

    a = load_file(str(tmp_path / "straight" / "drafter" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "drafter" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    losses_a = [r["train/loss"] for r in records(tmp_path / "straight") if "train/loss" in r]
    losses_b = [(r["step"], r["train/loss"]) for r in records(tmp_path / "resumed") if "train/loss" in r]
    # the interrupted run logged steps 1..4, the resumed one 4..6 (step 4 twice, with the same value)
    assert [s for s, _ in losses_b] == [1, 2, 3, 4, 4, 5, 6]
    values = [v for _, v in losses_b]
    assert values[:4] + values[5:] == losses_a and values[3] == values[4]
    evals_a = [r for r in records(tmp_path / "straight") if "eval/loss" in r]
    evals_b = [r for r in records(tmp_path / "resumed") if "eval/loss" in r]
    assert evals_a == evals_b  # held-out metrics at steps 3 and 6 and the final pass, identical


def test_medusa2_exports_an_adapter_that_loads_back(verifier_dir, tmp_path):
    run(verifier_dir, tmp_path, "--medusa.joint=true", "--medusa.lora_r=4", "--train.max_steps=3",
        "--medusa.lora_target_modules=[q_proj,v_proj]")
    assert {p.name for p in (tmp_path / "drafter" / "adapter").iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors"}
    assert {p.name for p in (tmp_path / "step-000003").glob("*.safetensors")} == {"model.safetensors"}
    stored = load_file(str(tmp_path / "step-000003" / "model.safetensors"))
    assert stored and all("lora_" in k or ".heads." in k for k in stored)  # adapters and heads, no frozen weights
    record = [r for r in records(tmp_path) if "train/loss" in r][-1]
    assert {"train/lm", "train/kl", "train/heads"} <= set(record)

    base = Verifier.from_pretrained(verifier_dir)
    ids = torch.randint(0, base.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    before = base.features(ids, return_logits=True).logits
    adapted = load_medusa_verifier(tmp_path / "drafter", Verifier.from_pretrained(verifier_dir))
    after = adapted.features(ids, return_logits=True).logits
    assert adapted.name.endswith("+adapter") and not torch.equal(before, after)  # the adapter trained and came back
    heads, meta = load_medusa(tmp_path / "drafter", base)
    assert meta["adapter"] == "adapter" and heads.num_heads == 3


def test_shared_head_trains_the_blocks_alone_and_exports_the_verifiers_head(verifier_dir, tmp_path):
    """medusa.shared_lm_head: checkpoints hold the ResBlocks only, the export carries the verifier's lm_head once
    (`original_lm_head`), and the reloaded export decodes as the trained heads did (the end-of-run check)."""
    summary = run(verifier_dir, tmp_path, "--medusa.shared_lm_head=true", "--medusa.loss=distill")
    stored = load_file(str(tmp_path / "step-000006" / "model.safetensors"))
    assert stored and all(".blocks." in k for k in stored)
    verifier = Verifier.from_pretrained(verifier_dir)
    heads, _ = load_medusa(tmp_path / "drafter", verifier)
    assert heads.shared_lm_head and torch.equal(heads.shared_head, verifier.lm_head.weight)
    assert any(p.abs().sum() > 0 for p in heads.parameters())  # the blocks trained
    logged = records(tmp_path)
    assert logged[-1]["eval/tau"] == logged[-1]["eval/tau_in_memory"] >= 1.0
    assert summary["consistency"]["tau"] == logged[-1]["eval/tau"]


def test_distill_loss_runs(verifier_dir, tmp_path):
    summary = run(verifier_dir, tmp_path, "--medusa.loss=distill", "--train.max_steps=2", "--train.warmup_steps=1",
                  "--train.eval_every=0")
    assert summary["loss"] == "distill" and summary["steps"] == 2


def test_wandb_offline_writes_a_run_folder(verifier_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run(verifier_dir, tmp_path, "--wandb.enabled=true", "--train.max_steps=2", "--train.warmup_steps=1",
        "--train.eval_every=0")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_unknown_config_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no_such_key"):
        parse_config(MedusaRunConfig, ["--medusa.no_such_key=1"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("medusa:\n  num_heads: 3\n  heads_typo: 2\n")
    with pytest.raises(ConfigError, match="heads_typo"):
        parse_config(MedusaRunConfig, ["--config", str(bad)])
    with pytest.raises(ConfigError, match="features=offline with medusa.joint=true"):
        parse_config(MedusaRunConfig, ["--features=offline", "--feature_cache=/tmp/x", "--medusa.joint=true"])


@pytest.mark.parametrize("name", ["medusa-tiny.yaml", "medusa2-tiny.yaml", "llama3-8b-medusa.yaml"])
def test_shipped_configs_parse(name):
    cfg = parse_config(MedusaRunConfig, ["--config", str(ROOT / "configs" / name)])
    assert cfg.medusa.joint == (name == "medusa2-tiny.yaml")


def test_accelerate_launch_subprocess(verifier_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTHEADS_QUIET": "1", "OMP_NUM_THREADS": "1"}
    args = small_args(verifier_dir, tmp_path / "run", "--train.max_steps=2", "--train.warmup_steps=1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes=1", "--num_machines=1",
           "--mixed_precision=no", "--dynamo_backend=no", "train/medusa.py",
           "--config", "configs/medusa-tiny.yaml", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "head-0 held-out top-1" in done.stdout
    assert (tmp_path / "run" / "drafter" / "config.json").is_file()
    # a wrong key: one line naming it, exit status 2
    bad = subprocess.run([sys.executable, "train/medusa.py", "--medusa.nope=1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "nope" in bad.stderr and "Traceback" not in bad.stderr
