"""The offline hidden-state cache (data/hidden_states.py, written by train/dump_features.py) on a random tiny verifier: offline training equals online
training step for step (Medusa and EAGLE-3), restart skips finished shards, and every broken cache is refused with
one clear error naming the file."""

import json
from pathlib import Path

import pytest
import torch

from draftheads.data.batching import build_datasets
from draftheads.data.hidden_states import CacheError, bytes_per_token, cached_datasets, read_index, verify_shards
from draftheads.data.hidden_states import main as cache_cli
from draftheads.models.verifier import Verifier
from draftheads.train.config import ConfigError, parse_config
from draftheads.train.dump_features import dump
from draftheads.train.dump_features import main as cli
from draftheads.train.features import feature_source
from draftheads.train.placement import load_verifier
from tests.utils import free_port, save_tiny_verifier_with_tokenizer

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread", "fresh_accelerate")


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    return save_tiny_verifier_with_tokenizer(tmp_path_factory.mktemp("cache-verifier") / "v")


@pytest.fixture(scope="module")
def text_rows(tmp_path_factory):
    """A small text source: ~30 training rows of 32 tokens and a few held-out ones (seconds, not minutes)."""
    path = tmp_path_factory.mktemp("cache-data") / "rows.jsonl"
    lines = [{"text": f"def f{i}(x):\n    return x * {i} + {i * i}  # number {i}\n" * 3} for i in range(14)]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def run_args(config: str, max_steps: int, inputs, output_dir) -> list[str]:
    """A short run of the tiny `config` on `inputs` (verifier folder, data source) into output_dir."""
    verifier_dir, source = inputs
    return ["--config", str(ROOT / "configs" / config), f"--verifier={verifier_dir}", f"--data.source={source}",
            f"--output_dir={output_dir}", "--wandb.enabled=false", "--data.seq_len=32", "--data.max_rows=null",
            "--data.eval_rows=2", "--train.batch_size=2", f"--train.max_steps={max_steps}", "--train.save_every=0",
            "--train.log_every=1", "--train.eval_every=0", "--train.eval_batches=2", "--train.warmup_steps=1"]


def medusa_args(inputs, output_dir, *extra):
    return [*run_args("medusa-tiny.yaml", 5, inputs, output_dir), "--medusa.num_heads=2", "--medusa.tree_budget=4",
            "--medusa.loss=distill", *extra]


def eagle3_args(inputs, output_dir, *extra):
    return [*run_args("eagle3-tiny.yaml", 4, inputs, output_dir), "--train.mixed_precision=no", "--eagle.ttt_steps=2",
            "--eagle.draft_vocab_size=200", "--eagle.layer_ids=null", *extra]


def medusa_cfg(*args):
    from draftheads.train.medusa import MedusaRunConfig

    return parse_config(MedusaRunConfig, list(args))


def eagle_cfg(*args):
    from draftheads.train.eagle import EagleRunConfig

    return parse_config(EagleRunConfig, list(args))


def quiet(*args, **kwargs):
    pass


def losses(run_dir: Path) -> list[dict]:
    """Every logged loss-like metric per step, from metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if "loss" in k or "acc" in k or "top" in k} for r in records]


def assert_same_losses(online: list[dict], offline: list[dict]):
    assert len(online) == len(offline) and online
    for a, b in zip(online, offline):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


def test_medusa_offline_training_equals_online(verifier_dir, text_rows, tmp_path):
    from draftheads.train.medusa import main

    main(medusa_cfg(*medusa_args((verifier_dir, text_rows), tmp_path / "online")))
    cache = tmp_path / "cache"
    result = dump(medusa_cfg(*medusa_args((verifier_dir, text_rows), tmp_path / "unused")), cache, dtype="float32",
                  rows_per_shard=3, say=quiet)
    assert result.written and not result.skipped
    index = read_index(cache)
    assert index["method"] == "medusa" and index["layer_ids"] == [] and index["dtype"] == "float32"
    main(medusa_cfg(*medusa_args((verifier_dir, text_rows), tmp_path / "offline", "--features=offline",
                                 f"--feature_cache={cache}")))
    assert_same_losses(losses(tmp_path / "online"), losses(tmp_path / "offline"))


def test_eagle3_offline_training_equals_online(verifier_dir, text_rows, tmp_path):
    from draftheads.train.eagle import main

    main(eagle_cfg(*eagle3_args((verifier_dir, text_rows), tmp_path / "online")))
    cache = tmp_path / "cache"
    dump(eagle_cfg(*eagle3_args((verifier_dir, text_rows), tmp_path / "unused")), cache, dtype="float32", rows_per_shard=4,
         say=quiet)
    index = read_index(cache)
    assert index["method"] == "eagle3" and index["layer_ids"] == [1, 2, 3]  # 4-layer verifier: 1, L//2, L-1
    main(eagle_cfg(*eagle3_args((verifier_dir, text_rows), tmp_path / "offline", "--features=offline",
                                f"--feature_cache={cache}")))
    assert_same_losses(losses(tmp_path / "online"), losses(tmp_path / "offline"))


def test_an_eagle3_cache_without_the_argmax_still_trains_and_resumes_without_it(verifier_dir, text_rows, tmp_path,
                                                                                  monkeypatch):
    """A version 2 cache (dumped before the argmax was stored): a run on it holds the whole lm_head and trains as on
    a version 3 cache; a dump resumed in it writes its missing shards without the argmax too, as version 2."""
    from safetensors.torch import load_file, save_file

    from draftheads.data.identity import sha256_file
    from draftheads.train import eagle as train_eagle

    cfg = eagle_cfg(*eagle3_args((verifier_dir, text_rows), tmp_path / "unused"))
    new, old = tmp_path / "new", tmp_path / "old"
    dump(cfg, new, dtype="float32", rows_per_shard=8, say=quiet)
    dump(cfg, old, dtype="float32", rows_per_shard=8, say=quiet)
    index = read_index(old)
    for split in ("train", "eval"):  # as an older version wrote them
        for meta in index["splits"][split]["shards"]:
            tensors = load_file(old / meta["file"])
            del tensors["argmax"]
            save_file(tensors, old / meta["file"])
            meta.update(bytes=(old / meta["file"]).stat().st_size, sha256=sha256_file(old / meta["file"]))
            (old / meta["file"].replace(".safetensors", ".json")).write_text(json.dumps(meta))
    plan = json.loads((old / "plan.json").read_text())
    for name, record in (("plan.json", plan), ("index.json", index)):
        del record["argmax"]
        record["version"] = 2
        (old / name).write_text(json.dumps(record))
    loaded = []
    load = train_eagle.load_verifier
    monkeypatch.setattr(train_eagle, "load_verifier", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    for cache in (new, old):
        train_eagle.main(eagle_cfg(*eagle3_args((verifier_dir, text_rows), tmp_path / f"run-{cache.name}",
                                                "--features=offline", f"--feature_cache={cache}")))
    assert [v.holds_whole_head for v, _ in loaded] == [False, True]
    assert_same_losses(losses(tmp_path / "run-new"), losses(tmp_path / "run-old"))
    (old / "index.json").unlink()
    (old / "train-00001.json").unlink()
    said = []
    assert dump(cfg, old, dtype="float32", rows_per_shard=8, say=said.append).written == ["train-00001.safetensors"]
    assert any("without the verifier's argmax, it goes on without it" in line for line in said), said
    assert read_index(old)["version"] == 2 and not read_index(old).get("argmax")
    assert "argmax" not in load_file(old / "train-00001.safetensors")
    verify_shards(old, read_index(old), check_hash=True)


def test_eagle1_trains_offline_from_an_eagle3_cache(verifier_dir, text_rows, tmp_path):
    """A cache with more than a run needs serves it: EAGLE-1 reads `final` of an EAGLE-3 cache (noise included)."""
    from draftheads.train.eagle import main

    inputs = (verifier_dir, text_rows)

    def eagle1(output_dir, *extra):
        return [a.replace("eagle3-tiny", "eagle1-tiny") for a in eagle3_args(inputs, output_dir, *extra)
                if not a.startswith(("--eagle.draft_vocab_size", "--eagle.layer_ids"))]

    main(eagle_cfg(*eagle1(tmp_path / "online")))
    cache = tmp_path / "cache"
    dump(eagle_cfg(*eagle3_args(inputs, tmp_path / "unused")), cache, dtype="float32", rows_per_shard=8, say=quiet)
    main(eagle_cfg(*eagle1(tmp_path / "offline", "--features=offline", f"--feature_cache={cache}")))
    assert "train/feature_loss" in losses(tmp_path / "offline")[0]  # EAGLE-1's loss parts
    assert_same_losses(losses(tmp_path / "online"), losses(tmp_path / "offline"))


def test_bf16_cache_is_close_and_estimate_is_sane(verifier_dir, text_rows, tmp_path):
    cfg = eagle_cfg(*eagle3_args((verifier_dir, text_rows), tmp_path / "run"))
    result = dump(cfg, tmp_path / "cache", rows_per_shard=4, say=quiet)
    index = read_index(tmp_path / "cache")
    assert index["dtype"] == "bfloat16"
    tokens = sum(index["splits"][s]["rows"] for s in ("train", "eval")) * 32
    assert index["argmax"] and result.estimate_bytes == bytes_per_token(64, 3, "bfloat16", argmax=True) * tokens
    assert 1.0 <= result.actual_bytes / result.estimate_bytes < 1.5  # safetensors headers are the difference
    train, _ = cached_datasets(cfg_with_cache(cfg, tmp_path / "cache"))
    row = train[0]
    verifier = Verifier.from_pretrained(verifier_dir)
    layer_ids = index["layer_ids"]  # the cache's order: stored layer i is layer_ids[i]'s input
    # the rows training builds, their document positions included (packed: restarting after each EOS)
    built, _ = build_datasets(cfg.data, load_verifier(cfg, torch.device("cpu"))[1], seed=cfg.train.seed)
    for key in ("input_ids", "loss_mask", "position_ids"):
        assert torch.equal(train[0][key].long(), built[0][key].long()), key
    packed = next(train[i] for i in range(len(train))  # 2+ documents, padding not counted
                  if ((train[i]["position_ids"][1:] == 0) & train[i]["attention_mask"][1:].bool()).any())
    positions = packed["position_ids"].long()
    feats = verifier.features(packed["input_ids"][None].long(), packed["attention_mask"][None].long(),
                              layer_ids=layer_ids, position_ids=positions[None])
    real = packed["attention_mask"].bool()  # the dump joins the padding to the last document (join_padding)
    torch.testing.assert_close(packed["final"][real].float(), feats.final[0][real], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(packed["layers"][2][real].float(), feats.layers[2][0][real], rtol=1e-2, atol=1e-2)
    # each document's features are its own: the second one computed alone
    start = int(torch.nonzero(positions[1:] == 0)[0]) + 1
    rest = torch.nonzero(positions[start + 1:] == 0)
    end = start + 1 + int(rest[0]) if len(rest) else 32
    alone = verifier.features(packed["input_ids"][None, start:end].long(), layer_ids=layer_ids)
    torch.testing.assert_close(packed["final"][start:end].float(), alone.final[0], rtol=1e-2, atol=1e-2)
    # the verifier's argmax over the whole vocabulary, of `final` as stored (what training computed from it before)
    assert row["argmax"].dtype == torch.int32
    assert torch.equal(row["argmax"].long(), verifier.lm_head(row["final"].float()).max(-1).indices)
    loader = torch.utils.data.DataLoader(train, batch_size=2, num_workers=1)  # workers reopen the shards
    assert torch.equal(next(iter(loader))["final"][0], row["final"])


def cfg_with_cache(cfg, folder):
    cfg.features, cfg.feature_cache = "offline", str(folder)
    return cfg


def test_restart_skips_finished_shards_and_redoes_a_half_written_one(verifier_dir, text_rows, tmp_path):
    cfg = medusa_cfg(*medusa_args((verifier_dir, text_rows), tmp_path / "run"))
    cache = tmp_path / "cache"
    first = dump(cfg, cache, rows_per_shard=2, say=quiet)
    shards = sorted(first.written)
    assert len(shards) >= 3
    before = {name: (cache / name).stat().st_mtime_ns for name in shards}
    victim = shards[1]
    # A crash after the rename but before the sidecar: the shard is there, but not done (and here also truncated).
    (cache / victim.replace(".safetensors", ".json")).unlink()
    data = (cache / victim).read_bytes()
    (cache / victim).write_bytes(data[: len(data) // 2])
    (cache / (shards[0] + ".tmp")).write_bytes(b"leftover of a crash")  # a stale tmp file is ignored
    (cache / "index.json").unlink()
    second = dump(cfg, cache, rows_per_shard=2, say=quiet)
    assert second.written == [victim]
    assert sorted(second.skipped) == sorted(set(shards) - {victim})
    assert all((cache / n).stat().st_mtime_ns == before[n] for n in shards if n != victim)
    verify_shards(cache, read_index(cache), check_hash=True)  # the redone shard is whole again


def test_restart_with_other_settings_is_refused(verifier_dir, text_rows, tmp_path):
    cfg = medusa_cfg(*medusa_args((verifier_dir, text_rows), tmp_path / "run"))
    dump(cfg, tmp_path / "cache", rows_per_shard=4, say=quiet)
    with pytest.raises(CacheError, match=r"plan\.json.*dtype='bfloat16'.*dtype='float16'"):
        dump(cfg, tmp_path / "cache", dtype="float16", rows_per_shard=4, say=quiet)
    # a cache started before backends were recorded was the HF forward's: it continues with hf, not with vllm
    plan = json.loads((tmp_path / "cache" / "plan.json").read_text())
    del plan["backend"]
    (tmp_path / "cache" / "plan.json").write_text(json.dumps(plan))
    assert dump(cfg, tmp_path / "cache", rows_per_shard=4, say=quiet).skipped
    with pytest.raises(CacheError, match=r"plan\.json.*backend='hf'.*backend='vllm'"):
        dump(cfg, tmp_path / "cache", rows_per_shard=4, say=quiet, backend="vllm")


def test_corrupted_shards_are_named(verifier_dir, text_rows, tmp_path):
    cfg = medusa_cfg(*medusa_args((verifier_dir, text_rows), tmp_path / "run"))
    cache = tmp_path / "cache"
    dump(cfg, cache, rows_per_shard=4, say=quiet)
    offline = cfg_with_cache(cfg, cache)
    shard = cache / "train-00000.safetensors"
    data = bytearray(shard.read_bytes())
    # Same size, flipped bytes in the tensor data: only the hash sees it.
    data[-10:] = bytes(b ^ 0xFF for b in data[-10:])
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=r"train-00000\.safetensors: sha256 differs"):
        verify_shards(cache, read_index(cache), check_hash=True)
    assert cache_cli(["verify", str(cache)]) == 2
    # ... and the training read, the first time its process opens the shard (it trained to the end before)
    train, _ = cached_datasets(offline)
    with pytest.raises(CacheError, match=r"train-00000\.safetensors: sha256 differs from index\.json"):
        train[0]
    # Truncated: the size check on every training start sees it.
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(CacheError, match=r"train-00000\.safetensors: \d+ bytes, index\.json records"):
        cached_datasets(offline)
    # A mangled header with the recorded size.
    data[8:40] = b"x" * 32
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=r"train-00000\.safetensors: unreadable safetensors header"):
        cached_datasets(offline)
    shard.unlink()
    with pytest.raises(CacheError, match=r"train-00000\.safetensors: shard missing"):
        cached_datasets(offline)


def test_a_token_id_outside_the_vocabulary_names_the_shard_and_row(verifier_dir, text_rows, tmp_path):
    """A negative (or too large) token id in a shard whose index was rewritten to match: one line naming the shard and
    the row, where the draft-vocabulary count (bincount) raised a RuntimeError before."""
    from safetensors.torch import load_file, save_file

    from draftheads.data.identity import sha256_file

    cfg = medusa_cfg(*medusa_args((verifier_dir, text_rows), tmp_path / "run"))
    cache = tmp_path / "cache"
    dump(cfg, cache, rows_per_shard=4, say=quiet)
    shard = cache / "train-00000.safetensors"
    tensors = load_file(str(shard))
    tensors["input_ids"][2, 5] = -7
    save_file(tensors, str(shard))
    index = json.loads((cache / "index.json").read_text())
    meta = index["splits"]["train"]["shards"][0]
    meta.update(bytes=shard.stat().st_size, sha256=sha256_file(shard))
    (cache / "index.json").write_text(json.dumps(index))
    train, _ = cached_datasets(cfg_with_cache(cfg, cache))
    with pytest.raises(CacheError, match=r"train-00000\.safetensors: row 2 holds token id -7 at position 5"):
        train[2]
    with pytest.raises(CacheError, match=r"row 2 holds token id -7"):
        next(train.iter())


def test_a_version_1_cache_is_refused_in_one_line(verifier_dir, text_rows, tmp_path):
    """Caches written before position_ids were stored: their packed features attended across documents."""
    cfg = medusa_cfg(*medusa_args((verifier_dir, text_rows), tmp_path / "run", "--data.max_rows=2"))
    cache = tmp_path / "cache"
    dump(cfg, cache, rows_per_shard=64, say=quiet)
    index = json.loads((cache / "index.json").read_text())
    (cache / "index.json").write_text(json.dumps({**index, "version": 1}))
    with pytest.raises(CacheError, match=r"index\.json: a version 1 cache \(no position_ids.*dump it again") as err:
        cached_datasets(cfg_with_cache(cfg, cache))
    assert "\n" not in str(err.value)


def test_wrong_verifier_wrong_data_and_missing_layers_are_refused(verifier_dir, text_rows, tmp_path):
    cfg = medusa_cfg(*medusa_args((verifier_dir, text_rows), tmp_path / "run"))
    cache = tmp_path / "cache"
    dump(cfg, cache, rows_per_shard=4, say=quiet)
    other = Verifier.from_pretrained(save_tiny_verifier_with_tokenizer(tmp_path / "other", seed=1))
    offline = cfg_with_cache(cfg, cache)
    with pytest.raises(CacheError, match=r"index\.json: the cache was dumped from verifier .* fingerprint="):
        feature_source(offline, other)
    with pytest.raises(ConfigError, match=r"holds layers \[\].*needs layers \[1, 2, 3\]"):
        feature_source(offline, Verifier.from_pretrained(verifier_dir), layer_ids=[1, 2, 3])
    offline.data.seq_len = 64
    with pytest.raises(CacheError, match=r"index\.json: the cache holds rows built with data\.seq_len=32"):
        cached_datasets(offline)
    with pytest.raises(CacheError, match=r"index\.json: no such file"):
        read_index(tmp_path / "nowhere")


def test_cli_dump_and_verify(verifier_dir, text_rows, tmp_path, capsys):
    args = medusa_args((verifier_dir, text_rows), tmp_path / "run")
    assert cli(["dump", *args, "--out", str(tmp_path / "cache"), "--rows_per_shard=4"]) == 0
    out = capsys.readouterr().out
    assert "estimated" in out and "on disk" in out
    assert cache_cli(["verify", str(tmp_path / "cache")]) == 0
    assert cli(["dump", *args, "--method", "eagle3", "--out", str(tmp_path / "c2")]) == 2  # an EAGLE config needed
    assert "medusa" in capsys.readouterr().err  # the EAGLE config class has no medusa section


def test_two_processes_split_the_shards(verifier_dir, text_rows, tmp_path):
    """torchrun with two CPU processes: shard i by process i % 2, one index, the same bytes as one process (every
    file: shards, sidecars, plan and index)."""
    import os
    import subprocess
    import sys

    args = ["dump", *eagle3_args((verifier_dir, text_rows), tmp_path / "run"), "--rows_per_shard=4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTHEADS_QUIET": "1", "ACCELERATE_USE_CPU": "true",
           "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run([str(torchrun), "--nproc_per_node=2", f"--master_port={free_port()}", "-m",
                             "draftheads.train.dump_features", *args,
                             "--out", str(tmp_path / "two")], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("estimated") == 1  # the main process speaks
    assert cli([*args, "--out", str(tmp_path / "one")]) == 0
    from draftheads.data.identity import sha256_file

    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "two").iterdir()) and len(names) > 4
    digests = [{n: sha256_file(tmp_path / run / n) for n in names} for run in ("one", "two")]
    assert digests[0] == digests[1]
