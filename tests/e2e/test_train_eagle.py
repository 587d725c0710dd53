"""train/eagle.py end to end on tiny random verifiers: run folders, export, resume equality, launch, config errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftheads.models.eagle import count_tokens, select_draft_vocab
from draftheads.models.export import load_eagle
from draftheads.models.verifier import Verifier
from draftheads.train.checkpoint import complete_checkpoints
from draftheads.train.config import ConfigError, parse_config
from draftheads.train.eagle import EagleRunConfig, draft_vocab_counts, main
from tests.utils import FAMILIES, crash_after_step, free_port, record_wandb_logs, reset_accelerate, \
    save_tiny_verifier

ROOT = Path(__file__).resolve().parents[2]


def save_verifier_with_tokenizer(folder, family):
    """A random tiny verifier with a small BPE tokenizer saved next to it (what `load_verifier` needs)."""
    from tests.chat_tokenizers import plain_tokenizer

    tokenizer = plain_tokenizer()
    vocab = -(-len(tokenizer) // 64) * 64
    save_tiny_verifier(folder, family, vocab_size=vocab, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def verifier_dirs(tmp_path_factory):
    """A tiny verifier with a tokenizer per family, and beside them a small text source (~30 rows of 32 tokens and a
    few held-out ones): each run reads seconds of data, not three stdlib files' thousands of rows."""
    root = tmp_path_factory.mktemp("eagle-verifiers")
    lines = [{"text": f"def f{i}(x):\n    return x * {i} + {i * i}  # number {i}\n" * 3} for i in range(14)]
    (root / "rows.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return {family: save_verifier_with_tokenizer(root / family, family) for family in FAMILIES}


pytestmark = pytest.mark.usefixtures("fresh_accelerate")


def tiny_args(verifier, output_dir, version, *extra, stdlib=False):
    """The tiny config with a test-sized run: the small text source beside the verifier (`stdlib`: the config's
    stdlib source, three files), 32-token rows, a few steps, small draft vocab and TTT, default feature layers (the
    test verifiers have 4 layers), fp32."""
    data = ["--data.max_rows=3"] if stdlib else [f"--data.source={Path(verifier).parent / 'rows.jsonl'}",
                                                   "--data.max_rows=null"]
    return ["--config", str(ROOT / f"configs/eagle{version}-tiny.yaml"), f"--verifier={verifier}",
            f"--output_dir={output_dir}", *data, "--data.seq_len=32", "--data.eval_rows=2",
            "--train.batch_size=2", "--train.max_steps=4", "--train.save_every=2", "--train.eval_every=2",
            "--train.eval_batches=2", "--train.log_every=1", "--train.warmup_steps=1", "--wandb.enabled=false",
            "--train.mixed_precision=no", "--eagle.ttt_steps=3",
            *(["--eagle.draft_vocab_size=200", "--eagle.layer_ids=null"] if version == 3 else []), *extra]


def run(*args) -> dict:
    reset_accelerate()
    return main(parse_config(EagleRunConfig, list(args)))


def records(folder):
    return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


# ---- a whole run ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [1, 3])
def test_tiny_config_trains_checkpoints_and_exports(tmp_path, verifier_dirs, version):
    out = tmp_path / "run"
    summary = run(*tiny_args(verifier_dirs["llama"], out, version))

    assert (out / "config.yaml").is_file()
    assert [p.name for p in complete_checkpoints(out)] == ["step-000002", "step-000004"]
    logged = records(out)
    train = [r for r in logged if "train/loss" in r]
    evals = [r for r in logged if "eval/acc_0" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["step"] for r in evals] == [2, 4]  # the last eval_every step is also the end: evaluated once
    K = 3  # --eagle.ttt_steps=3: EAGLE-3 trains 3 steps; EAGLE-1 trains one and is scored on 3-token chains
    for key in ("eval/loss", "eval/accept_length", *(f"eval/{m}_{k}" for m in ("acc", "cond_acc", "cum_acc")
                                                       for k in range(K))):
        assert key in evals[-1], key
    assert 1.0 <= evals[-1]["eval/accept_length"] <= 1 + K
    trained_steps = K if version == 3 else 1
    assert [k for k in train[-1] if k.startswith("train/acc_")] == [f"train/acc_{k}" for k in range(trained_steps)]
    assert "train/tokens_per_s" in train[-1]

    verifier = Verifier.from_pretrained(verifier_dirs["llama"])
    drafter = load_eagle(out / "drafter", verifier)
    meta = json.loads((out / "drafter" / "config.json").read_text())["draftheads"]
    assert meta["method"] == f"eagle{version}" and meta["training"]["steps"] == 4 == summary["steps"]
    assert meta["training"]["eval/acc_0"] == evals[-1]["eval/acc_0"]
    # the exported weights are the ones the last checkpoint holds
    state = load_file(out / "step-000004" / "model.safetensors")
    for name, value in drafter.state_dict().items():
        torch.testing.assert_close(value, state[f"drafter.{name}"], rtol=0, atol=0)
    if version == 3:  # the draft vocabulary: the 200 most frequent training targets
        from draftheads.data.batching import build_datasets

        cfg = parse_config(EagleRunConfig, tiny_args(verifier_dirs["llama"], out, version))
        tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(verifier_dirs["llama"])
        train_ds, _ = build_datasets(cfg.data, tokenizer, seed=cfg.train.seed)
        d2t, t2d = select_draft_vocab(draft_vocab_counts(train_ds, verifier.vocab_size), 200)
        assert torch.equal(drafter.d2t.cpu(), d2t) and torch.equal(drafter.t2d.cpu(), t2d)
        assert 0 < summary["draft_vocab_coverage"] <= 1
    else:
        assert "fc.bias" not in drafter.state_dict()  # the tiny config trains EAGLE-1 without an fc bias
    # the end-of-run train/serve check: the reloaded export's tau on held-out prompts, equal to the in-memory one
    assert logged[-1]["step"] == 4 and logged[-1]["eval/tau"] == logged[-1]["eval/tau_in_memory"] >= 1.0
    assert summary["consistency"]["tau"] == logged[-1]["eval/tau"] and summary["consistency"]["new_tokens"] > 0


def reverse_fc_blocks(folder, hidden_size):
    """Tamper with an export: the feature blocks of fc in reverse order (EAGLE-1: [f; e] for [e; f])."""
    from safetensors.torch import save_file

    tensors = load_file(Path(folder) / "model.safetensors")
    tensors["fc.weight"] = torch.cat(tensors["fc.weight"].split(hidden_size, dim=1)[::-1], 1).contiguous()
    save_file(tensors, Path(folder) / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("version", [1, 3])
def test_broken_export_fails_the_run(tmp_path, verifier_dirs, monkeypatch, version):
    from draftheads.train import eagle as train_eagle
    from draftheads.eval.measure.consistency import ConsistencyError

    def export_then_break(drafter, folder, verifier, **kwargs):
        written = export_eagle(drafter, folder, verifier, **kwargs)
        reverse_fc_blocks(written, verifier.hidden_size)
        return written

    export_eagle = train_eagle.export_eagle
    monkeypatch.setattr(train_eagle, "export_eagle", export_then_break)
    with pytest.raises(ConsistencyError, match=r"train/serve check failed: .*the exported eagle drafter, reloaded, "
                                               r"reaches tau .*first differs at verifier call"):
        # the stdlib rows: on the small source the check's held-out prompts did not tell the reversed fc blocks
        # apart (EAGLE-3's run ended with no error), so the test would check nothing
        run(*tiny_args(verifier_dirs["llama"], tmp_path, version, stdlib=True))
    assert not any("eval/tau" in r for r in records(tmp_path))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains(tmp_path, verifier_dirs, family):
    out = tmp_path / family
    run(*tiny_args(verifier_dirs[family], out, 3, "--train.max_steps=2", "--engine=sglang"))
    verifier = Verifier.from_pretrained(verifier_dirs[family])
    drafter = load_eagle(out / "drafter", verifier)
    assert drafter.model_type == verifier.config.model_type
    assert any(k.startswith("midlayer.") for k in load_file(out / "drafter" / "model.safetensors"))


def test_wandb_offline_and_bf16_export(tmp_path, verifier_dirs, monkeypatch):
    logged = record_wandb_logs(monkeypatch)  # every log names its step, never going back
    out = tmp_path / "run"
    run(*tiny_args(verifier_dirs["llama"], out, 3, "--train.max_steps=2", "--wandb.enabled=true",
                   "--wandb.mode=offline", "--export_dtype=bfloat16", "--train.mixed_precision=bf16"))
    assert list((out / "wandb").glob("offline-run-*"))
    steps = [step for step, _ in logged]
    assert None not in steps and steps == sorted(steps), steps
    keys = set().union(*(k for _, k in logged))
    assert {"eval/acc_0", "eval/per_step", "eval/tau", "train/loss"} <= keys, keys
    tensors = load_file(out / "drafter" / "model.safetensors")
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64


# ---- resume --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [1, 3])  # EAGLE-1 draws feature noise: the RNG state must resume too
def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(tmp_path, verifier_dirs, monkeypatch, version):
    N = 3
    args = ("--train.max_steps=6", f"--train.save_every={N}", "--train.eval_every=3")
    run(*tiny_args(verifier_dirs["llama"], tmp_path / "straight", version, *args))
    crash_after_step(monkeypatch, N, lambda: run(*tiny_args(verifier_dirs["llama"], tmp_path / "resumed", version,
                                                            *args)))
    run(*tiny_args(verifier_dirs["llama"], tmp_path / "resumed", version, *args))

    straight = load_file(tmp_path / "straight" / "drafter" / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "drafter" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)

    def losses(folder):
        return {(r["step"], k): v for r in records(folder) for k, v in r.items()
                if k == "train/loss" or k.startswith("eval/")}

    a, b = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert a == b and {step for step, _ in a} == set(range(1, 7))


def test_a_run_resolved_otherwise_is_not_continued(tmp_path, verifier_dirs, monkeypatch):
    """run.json keeps what the EAGLE-3 drafter's defaults resolved to (feature layers, noise, the weights' shapes);
    a continuation under other defaults (here: other feature layers, as a changed default_eagle3_layers would give)
    stops naming the field."""
    args = ("--train.max_steps=4", "--train.save_every=2", "--train.eval_every=0", "--consistency.enabled=false")
    out = tmp_path / "run"
    crash_after_step(monkeypatch, 2, lambda: run(*tiny_args(verifier_dirs["llama"], out, 3, *args)))
    record = json.loads((out / "run.json").read_text())
    resolved = record["resolved"]["eagle"]
    assert resolved["feature_layers"] and "fc.weight" in resolved["shapes"] and resolved["input_noise"] == 0
    edited = {**resolved, "feature_layers": [0, 1, 2]}
    assert edited["feature_layers"] != resolved["feature_layers"]
    (out / "run.json").write_text(json.dumps({**record, "resolved": {"eagle": edited}}))
    with pytest.raises(ConfigError, match=r"eagle\.feature_layers: \[0, 1, 2\] -> \["):
        run(*tiny_args(verifier_dirs["llama"], out, 3, *args))
    (out / "run.json").write_text(json.dumps(record))
    run(*tiny_args(verifier_dirs["llama"], out, 3, *args))  # as recorded: it continues to its end
    assert [r["step"] for r in records(out) if "train/loss" in r] == [1, 2, 3, 4]


# ---- pieces --------------------------------------------------------------------------------------------------
def test_draft_vocab_counts_match_a_direct_count(tmp_path):
    import datasets

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (37, 16), generator=g)
    mask = (torch.rand(37, 16, generator=g) > 0.3).long()
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "loss_mask": mask.tolist()}).with_format("torch")
    counts = draft_vocab_counts(ds, 50, rows_per_chunk=8)
    assert torch.equal(counts, count_tokens(ids, mask, 50))
    assert int(counts.sum()) == int(mask.sum())


def test_unknown_config_keys_are_named(tmp_path):
    with pytest.raises(ConfigError, match="ttt_stepz"):
        parse_config(EagleRunConfig, ["--config", str(ROOT / "configs/eagle3-tiny.yaml"), "--eagle.ttt_stepz=3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs/eagle1-tiny.yaml").read_text().replace("noise: 0.2", "noize: 0.2"))
    with pytest.raises(ConfigError, match="noize"):
        parse_config(EagleRunConfig, ["--config", str(bad)])
    with pytest.raises(ConfigError, match="eagle.ttt_steps"):
        parse_config(EagleRunConfig, ["--eagle.ttt_steps=0"])
    with pytest.raises(ConfigError, match="features=offline needs feature_cache"):
        parse_config(EagleRunConfig, ["--features=offline"])


@pytest.mark.parametrize("name", ["eagle1-tiny", "eagle3-tiny", "llama3-8b-eagle1", "llama3-8b-eagle3",
                                  "qwen3-8b-eagle3"])
def test_shipped_configs_parse(name):
    cfg = parse_config(EagleRunConfig, ["--config", str(ROOT / f"configs/{name}.yaml")])
    assert cfg.eagle.version == int(name.split("eagle")[-1][0]) and cfg.eagle.use_fc_bias is False


# ---- the real launcher ---------------------------------------------------------------------------------------
def test_accelerate_launch(tmp_path, verifier_dirs):
    out = tmp_path / "launched"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTHEADS_QUIET": "1", "WANDB_MODE": "offline"}
    launcher = Path(sys.executable).with_name("accelerate")
    command = [str(launcher), "launch", "--num_processes=1", "--num_machines=1", "--mixed_precision=no",
               "--dynamo_backend=no", "--cpu", str(ROOT / "train/eagle.py"),
               *tiny_args(verifier_dirs["llama"], out, 3, "--train.max_steps=2")]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "drafter" / "config.json").is_file() and len(records(out)) >= 2
    # a bad key ends in one line naming it, exit status 2
    result = subprocess.run([sys.executable, str(ROOT / "train/eagle.py"), "--eagle.bogus=1"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "bogus" in result.stderr and "Traceback" not in result.stderr


def test_two_processes(tmp_path, verifier_dirs):
    """DDP over two CPU processes (gloo): one prepare, held-out sums reduced, per-process RNG in checkpoints."""
    out = tmp_path / "ddp"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTHEADS_QUIET": "1", "WANDB_MODE": "offline",
           "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    launcher = Path(sys.executable).with_name("accelerate")  # without GPUs: two gloo processes (ACCELERATE_USE_CPU)
    command = [str(launcher), "launch", "--multi_gpu", "--num_processes=2", "--num_machines=1",
               f"--main_process_port={free_port()}", "--mixed_precision=no",
               "--dynamo_backend=no", str(ROOT / "train/eagle.py"),
               *tiny_args(verifier_dirs["llama"], out, 3, "--train.max_steps=2")]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {p.name for p in (out / "step-000002").glob("random_states_*.pkl")} == {"random_states_0.pkl",
                                                                                  "random_states_1.pkl"}
    assert load_eagle(out / "drafter", Verifier.from_pretrained(verifier_dirs["llama"])).draft_vocab_size == 200
    assert [r["step"] for r in records(out) if "eval/acc_0" in r] == [2]
    assert [r["step"] for r in records(out) if "eval/tau" in r] == [2]  # checked once, by the main process


BROKEN_EXPORT_LAUNCHER = """
import sys
from draftheads.train import eagle as train_eagle
from tests.e2e.test_train_eagle import reverse_fc_blocks
from draftheads.train.cli import main_guard

export_eagle = train_eagle.export_eagle

def export_then_break(drafter, folder, verifier, **kwargs):
    written = export_eagle(drafter, folder, verifier, **kwargs)
    reverse_fc_blocks(written, verifier.hidden_size)
    return written

train_eagle.export_eagle = export_then_break
main_guard(train_eagle.main, train_eagle.EagleRunConfig)
"""


def test_two_processes_broken_export_exits_nonzero(tmp_path, verifier_dirs):
    """A broken export fails both processes (the other one does not wait forever) with a message saying why."""
    script = tmp_path / "broken_export.py"
    script.write_text(BROKEN_EXPORT_LAUNCHER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTHEADS_QUIET": "1", "WANDB_MODE": "offline",
           "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    # the stdlib rows: after two steps on the small source the reversed fc blocks went unseen by the check (exit 0)
    command = [str(torchrun), "--nproc_per_node=2", str(script),
               *tiny_args(verifier_dirs["llama"], tmp_path / "ddp", 3, "--train.max_steps=2", stdlib=True)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "train/serve check failed" in result.stderr and "on the main process" in result.stderr
