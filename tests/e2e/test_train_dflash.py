"""train/dflash.py end to end on tiny random verifiers: run folder, export, the train/serve check, resume equality,
offline features, config errors, the shipped configs."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftheads.models.export import load_dflash
from draftheads.models.verifier import Verifier
from draftheads.train.checkpoint import complete_checkpoints
from draftheads.train.config import ConfigError, parse_config
from draftheads.train.dflash import DFlashRunConfig, main
from tests.e2e.test_train_eagle import save_verifier_with_tokenizer
from tests.utils import crash_after_step, record_wandb_logs, reset_accelerate

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("fresh_accelerate")


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    """A tiny Qwen3 verifier with a tokenizer, and beside it a small text source (~30 rows of 32 tokens and a few
    held-out ones): every run and the feature dump read seconds of data, not three stdlib files' thousands of rows."""
    folder = save_verifier_with_tokenizer(tmp_path_factory.mktemp("dflash-verifier") / "qwen3", "qwen3")
    lines = [{"text": f"def f{i}(x):\n    return x * {i} + {i * i}  # number {i}\n" * 3} for i in range(14)]
    (folder.parent / "rows.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return folder


def tiny_args(verifier, output_dir, *extra):
    """The tiny config, test-sized: the small text source beside the verifier, 32-token rows, a few steps, block 4,
    6 anchors per row, fp32."""
    return ["--config", str(ROOT / "configs/dflash-tiny.yaml"), f"--verifier={verifier}",
            f"--data.source={Path(verifier).parent / 'rows.jsonl'}", f"--output_dir={output_dir}",
            "--data.seq_len=32", "--data.max_rows=null", "--data.eval_rows=2",
            "--train.batch_size=2", "--train.max_steps=4", "--train.save_every=2", "--train.eval_every=2",
            "--train.eval_batches=2", "--train.log_every=1", "--train.warmup_steps=1", "--wandb.enabled=false",
            "--train.mixed_precision=no", "--dflash.block_size=4", "--dflash.num_anchors=6",
            "--consistency.num_prompts=2", "--consistency.max_new_tokens=12", *extra]


def run(*args) -> dict:
    reset_accelerate()
    return main(parse_config(DFlashRunConfig, list(args)))


def records(folder):
    return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


def test_tiny_config_trains_checkpoints_exports_and_checks(tmp_path, verifier_dir):
    out = tmp_path / "run"
    summary = run(*tiny_args(verifier_dir, out))
    assert [p.name for p in complete_checkpoints(out)] == ["step-000002", "step-000004"]
    logged = records(out)
    train = [r for r in logged if "train/loss" in r]
    evals = [r for r in logged if "eval/acc_1" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    for key in ("eval/loss", "eval/accept_length", *(f"eval/{m}_{k}" for m in ("acc", "cond_acc", "cum_acc")
                                                       for k in (1, 2, 3))):
        assert key in evals[-1], key
    assert 1.0 <= evals[-1]["eval/accept_length"] <= 4 and "train/pos_loss_3" in train[-1]

    verifier = Verifier.from_pretrained(verifier_dir)
    drafter = load_dflash(out / "drafter", verifier)
    meta = json.loads((out / "drafter" / "config.json").read_text())
    assert meta["architectures"] == ["DFlashDraftModel"] and meta["draftheads"]["method"] == "dflash"
    assert meta["draftheads"]["training"]["steps"] == 4 == summary["steps"]
    state = load_file(out / "step-000004" / "model.safetensors")  # the export holds the last checkpoint's weights
    for name, value in drafter.state_dict().items():
        torch.testing.assert_close(value, state[f"drafter.{name}"], rtol=0, atol=0)
    assert logged[-1]["eval/tau"] == logged[-1]["eval/tau_in_memory"] >= 1.0
    assert summary["consistency"]["new_tokens"] > 0


def test_wandb_offline_run_logs_every_step_in_order(tmp_path, verifier_dir, monkeypatch):
    """wandb on (offline, as a user without a key runs it): the run folder holds the wandb run, every log names its
    training step and none goes back (wandb drops a log to an earlier step), the train, held-out and end-of-run
    check metrics among them."""
    logged = record_wandb_logs(monkeypatch)
    out = tmp_path / "run"
    run(*tiny_args(verifier_dir, out, "--train.max_steps=2", "--wandb.enabled=true", "--wandb.mode=offline"))
    assert list((out / "wandb").glob("offline-run-*"))
    steps = [step for step, _ in logged]
    assert steps and None not in steps and steps == sorted(steps), steps
    keys = set().union(*(k for _, k in logged))
    assert {"train/loss", "eval/loss", "eval/accept_length", "eval/tau"} <= keys, keys


def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(tmp_path, verifier_dir, monkeypatch):
    """Anchors are random: the resumed run must draw what the uninterrupted one drew (the RNG state resumes)."""
    args = ("--train.max_steps=4", "--train.save_every=2", "--train.eval_every=2", "--consistency.enabled=false")
    run(*tiny_args(verifier_dir, tmp_path / "straight", *args))
    crash_after_step(monkeypatch, 2, lambda: run(*tiny_args(verifier_dir, tmp_path / "resumed", *args)))
    run(*tiny_args(verifier_dir, tmp_path / "resumed", *args))
    straight = load_file(tmp_path / "straight" / "drafter" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "drafter" / "model.safetensors")
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)

    def losses(folder):
        return {(r["step"], k): v for r in records(folder) for k, v in r.items()
                if k == "train/loss" or k.startswith("eval/")}

    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")


def test_a_run_resolved_otherwise_is_not_continued(tmp_path, verifier_dir, monkeypatch):
    """run.json keeps the drafter's settings as resolved when the run started (its nulls filled from the verifier);
    a continuation that resolves them otherwise (a newer version's default, here a mask token one higher) stops
    naming the field, for the folder's record and for the checkpoint's."""
    args = ("--train.max_steps=4", "--train.save_every=2", "--train.eval_every=0", "--consistency.enabled=false")
    out = tmp_path / "run"
    crash_after_step(monkeypatch, 2, lambda: run(*tiny_args(verifier_dir, out, *args)))
    resolved = json.loads((out / "run.json").read_text())["resolved"]["dflash"]
    assert resolved["mask_token_id"] is not None and resolved["target_layer_ids"] and resolved["hidden_size"]
    mask = resolved["mask_token_id"]
    for record in (out / "run.json", out / "step-000002" / "run.json"):
        edited = json.loads(record.read_text())
        edited["resolved"]["dflash"]["mask_token_id"] = mask + 1  # as if an older version had resolved it so
        record.write_text(json.dumps(edited))
        with pytest.raises(ConfigError, match=rf"dflash\.mask_token_id: {mask + 1} -> {mask}\)"):
            run(*tiny_args(verifier_dir, out, *args))
        # as an older version wrote it: without dflash.draft_vocab_size, a setting added since at its null default
        older = {k: v for k, v in resolved.items() if k != "draft_vocab_size"}
        signature = {k: v for k, v in edited["signature"].items() if k != "dflash.draft_vocab_size"}
        assert len(older) < len(resolved) and len(signature) < len(edited["signature"])
        record.write_text(json.dumps({**edited, "signature": signature, "resolved": {"dflash": older}}))
    run(*tiny_args(verifier_dir, out, *args))  # the records agree again: the run continues to its end
    assert [r["step"] for r in records(out) if "train/loss" in r] == [1, 2, 3, 4]


def test_an_engine_that_cannot_serve_the_verifier_is_refused_before_training(tmp_path):
    """engine sglang with a Qwen2 verifier (SGLang 0.5.23 has no DFlash capture for it): one config error once the
    verifier is read, before any step or checkpoint."""
    qwen2 = save_verifier_with_tokenizer(tmp_path / "qwen2", "qwen2")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": "def f(x):\n    return x\n" * 8}) + "\n")
    with pytest.raises(ConfigError, match="^engine sglang with a qwen2 verifier"):
        run(*tiny_args(qwen2, tmp_path / "run", "--engine=sglang"))
    assert not complete_checkpoints(tmp_path / "run")


def test_offline_features_train_the_same_drafter(tmp_path, verifier_dir):
    from draftheads.train.dump_features import dump

    args = tiny_args(verifier_dir, tmp_path / "online", "--consistency.enabled=false", "--train.max_steps=2",
                     "--train.save_every=0", "--train.eval_every=0")
    cfg = parse_config(DFlashRunConfig, args)
    dump(cfg, tmp_path / "cache", dtype="float32")
    assert json.loads((tmp_path / "cache" / "index.json").read_text())["argmax"]  # the blocks are scored against it
    run(*args)
    run(*[a.replace("online", "offline") for a in args], "--features=offline", f"--feature_cache={tmp_path / 'cache'}")
    scores = [[{k: v for k, v in r.items() if "acc" in k} for r in records(tmp_path / mode)]
              for mode in ("online", "offline")]
    assert scores[0] == scores[1] and any(scores[0])
    online = load_file(tmp_path / "online" / "drafter" / "model.safetensors")
    offline = load_file(tmp_path / "offline" / "drafter" / "model.safetensors")
    for key in online:
        torch.testing.assert_close(offline[key], online[key], rtol=1e-4, atol=1e-5)


def test_config_errors_are_named():
    with pytest.raises(ConfigError, match="dflash.block_size=64 > data.seq_len=32"):
        parse_config(DFlashRunConfig, ["--dflash.block_size=64", "--data.seq_len=32"])
    with pytest.raises(ConfigError, match="dflash.num_anchorz"):
        parse_config(DFlashRunConfig, ["--dflash.num_anchorz=3"])
    with pytest.raises(ConfigError, match="increasing"):
        parse_config(DFlashRunConfig, ["--dflash.target_layer_ids=[5,1]"])


@pytest.mark.parametrize("name, block, gamma", [("dflash-tiny", 5, 2.875), ("qwen3-8b-dflash", 16, 7.0)])
def test_shipped_configs_parse(name, block, gamma):
    cfg = parse_config(DFlashRunConfig, ["--config", str(ROOT / f"configs/{name}.yaml")])
    assert cfg.dflash.block_size == block and cfg.dflash.loss_gamma == gamma


def test_two_processes(tmp_path, verifier_dir):
    """DDP over two CPU processes (gloo) through `accelerate launch`: held-out sums reduced, each process's RNG (its
    anchors) in the checkpoint, one export, checked once by the main process."""
    import os
    import subprocess
    import sys

    from tests.utils import free_port

    out = tmp_path / "ddp"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTHEADS_QUIET": "1", "WANDB_MODE": "offline",
           "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    launcher = Path(sys.executable).with_name("accelerate")
    command = [str(launcher), "launch", "--multi_gpu", "--num_processes=2", "--num_machines=1",
               f"--main_process_port={free_port()}", "--mixed_precision=no", "--dynamo_backend=no",
               str(ROOT / "train/dflash.py"), *tiny_args(verifier_dir, out, "--train.max_steps=2")]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {p.name for p in (out / "step-000002").glob("random_states_*.pkl")} == {"random_states_0.pkl",
                                                                                  "random_states_1.pkl"}
    assert load_dflash(out / "drafter", Verifier.from_pretrained(verifier_dir)).block_size == 4
    assert [r["step"] for r in records(out) if "eval/tau" in r] == [2]
