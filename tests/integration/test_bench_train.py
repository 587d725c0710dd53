"""scripts/bench_train.py: one tiny round of each registered method writes a complete report."""

import json
from pathlib import Path

import pytest
import torch

from tests.utils import save_tiny_verifier_with_tokenizer, script_module

ROOT = Path(__file__).resolve().parents[2]


def bench_module():
    return script_module("bench_train")


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    return save_tiny_verifier_with_tokenizer(tmp_path_factory.mktemp("bench") / "v")


# The tiny configs' settings a 4-layer test verifier cannot take: EAGLE-3's layer ids and draft vocabulary.
EXTRA = {"eagle3": ["--eagle.layer_ids=null", "--eagle.draft_vocab_size=200", "--eagle.ttt_steps=3"]}


@pytest.mark.parametrize("method", sorted(bench_module().METHODS))
def test_bench_reports_a_ratio(method, verifier_dir, tmp_path):
    bench = bench_module()
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    try:
        report = bench.main(["--method", method, "--repeats", "2", "--warmup", "1", "--batches", "1",
                             "--threads", "1", "--flops", "--out", str(out), "--verifier", str(verifier_dir),
                             "--data.seq_len=32", "--data.max_rows=2", "--data.eval_rows=1",
                             "--train.batch_size=2", "--wandb.enabled=false", *EXTRA.get(method, [])])
    finally:
        torch.set_num_threads(threads)
    saved = json.loads(out.read_text())
    assert saved["method"] == method and len(saved["rounds"]) == 2
    assert saved["ratio_min"] <= saved["ratio_median"] <= saved["ratio_max"] and saved["ratio_median"] > 0
    assert saved["tokens_per_round"] == 2 * 32 and report["seq_len"] == 32
    assert saved["goal"] == {"medusa": None, "eagle1": 0.7, "eagle3": 0.5}[method]
    # a train step runs the verifier forward and more: the FLOPs allow a ratio below 1
    assert 0 < saved["forward_gflop"] < saved["train_gflop"]
    assert saved["flop_ceiling"] == pytest.approx(saved["forward_gflop"] / saved["train_gflop"])


def test_eagle_method_and_config_version_must_agree():
    from draftheads.train.config import ConfigError

    with pytest.raises(ConfigError, match="--method eagle1 with eagle.version=3: use --method eagle3"):
        bench_module().main(["--method", "eagle1", "--config", str(ROOT / "configs/eagle3-tiny.yaml"),
                             "--verifier", "does-not-matter-yet"])
