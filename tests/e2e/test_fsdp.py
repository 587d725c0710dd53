"""FSDP on two CPU processes (torchrun, gloo): the sharded verifier, drafters trained on it, and the export of a
sharded drafter. The checks run in tests/fsdp_worker.py (one process per rank); this test launches it and reads what
each rank measured.

What this covers without GPUs: `train.placement.fully_shard_verifier` (decoder layers sharded with FSDP2, embedding /
norm / lm_head whole), that features and logits are unchanged by it, that Medusa heads and an EAGLE-3 drafter
trained on it end with the same weights as on the whole verifier, that `train.placement.unsharded` gathers an FSDP2-sharded
drafter into a complete copy whose export equals the export of the same training without sharding, and that the
train/serve check runs on every process against a sharded verifier. Not covered (Accelerate refuses FSDP on the
CPU): `accelerate launch --config_file configs/accelerate/fsdp.yaml` itself, i.e. Accelerate's own wrapping and its
FULL_STATE_DICT checkpoints.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.utils import save_tiny_verifier

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    verifier = save_tiny_verifier(root / "verifier")
    out = root / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DRAFTHEADS_QUIET": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=2",
                             str(ROOT / "tests" / "fsdp_worker.py"), str(verifier), str(out)],
                            env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_sharded_verifier_computes_the_same_features(ranks):
    _, results = ranks
    for r in results:
        assert r["world"] == 2
        assert r["layer_param_is_dtensor"] and r["layer_local_rows"] * 2 == r["layer_full_rows"]  # half per rank
        assert r["resharded_after_forward"]  # no layer keeps its gathered weights after the forward
        assert r["whole_kept"] == ["Parameter"] * 3  # embedding, norm, lm_head not sharded
        assert r["features_max_diff"] == 0.0


def test_drafters_train_the_same_on_a_sharded_verifier(ranks):
    _, results = ranks
    for r in results:
        assert r["eagle_train_max_diff"] == 0.0
        assert r["medusa_train_max_diff"] == 0.0


def test_export_of_a_sharded_drafter_is_complete(ranks):
    out, results = ranks
    for r in results:
        assert r["drafter_was_sharded"] and r["unsharded_is_plain"]
    sharded = load_file(out / "eagle-sharded" / "model.safetensors")
    whole = load_file(out / "eagle-whole" / "model.safetensors")
    assert sharded.keys() == whole.keys()
    for key in whole:
        assert sharded[key].shape == whole[key].shape, key
        assert torch.equal(sharded[key], whole[key]), key


def test_train_serve_check_runs_on_every_process_with_a_sharded_verifier(ranks):
    _, results = ranks
    assert results[0]["check_tau"] == results[0]["check_tau_whole"]  # the same verdict as on the whole verifier
    assert results[1]["check_tau"] is None  # reported by the main process only
