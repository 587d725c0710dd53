"""train/dflash.py with --dflash.loss=dpace on a tiny local verifier: it trains, logs a finite loss, exports a
drafter that loads, and the export records the loss it was trained with."""

import json
import math

import pytest

from draftheads.models.export import load_dflash
from draftheads.models.verifier import Verifier
from tests.e2e.test_train_dflash import records, run, tiny_args
from tests.e2e.test_train_eagle import save_verifier_with_tokenizer

pytestmark = pytest.mark.usefixtures("fresh_accelerate", "one_thread")


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    folder = save_verifier_with_tokenizer(tmp_path_factory.mktemp("dpace-verifier") / "qwen3", "qwen3")
    lines = [{"text": f"def f{i}(x):\n    return x * {i} + {i * i}  # number {i}\n" * 3} for i in range(14)]
    (folder.parent / "rows.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return folder


def test_dpace_run_trains_and_exports(tmp_path, verifier_dir):
    out = tmp_path / "run"
    summary = run(*tiny_args(verifier_dir, out, "--dflash.loss=dpace", "--dflash.dpace_alpha=0.4",
                             "--train.max_steps=2", "--consistency.num_prompts=1"))
    train = [r for r in records(out) if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["train/loss"]) for r in train)
    assert "train/pos_loss_3" in train[-1]
    drafter = load_dflash(out / "drafter", Verifier.from_pretrained(verifier_dir))
    assert drafter.cfg.loss == "dpace" and drafter.cfg.loss_alpha == 0.4
    assert summary["steps"] == 2 and summary["consistency"]["new_tokens"] > 0
