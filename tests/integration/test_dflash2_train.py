"""train/dflash.py with --dflash.variant=dflash2 on a tiny local verifier: it trains (the selector's loss in the
total), exports vLLM's DFlash2 layout, the export reads back as a DFlash2 drafter, and the end-of-run check decodes
with it through our engine."""

import json
import math

import pytest

from draftheads.models.dflash2 import DFlash2Drafter
from draftheads.models.export import load_dflash
from draftheads.models.verifier import Verifier
from tests.e2e.test_train_dflash import records, run, tiny_args
from tests.e2e.test_train_eagle import save_verifier_with_tokenizer

pytestmark = pytest.mark.usefixtures("fresh_accelerate", "one_thread")


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    folder = save_verifier_with_tokenizer(tmp_path_factory.mktemp("dflash2-verifier") / "qwen3", "qwen3")
    lines = [{"text": f"def f{i}(x):\n    return x * {i} + {i * i}  # number {i}\n" * 3} for i in range(14)]
    (folder.parent / "rows.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return folder


def test_dflash2_run_trains_and_exports(tmp_path, verifier_dir):
    out = tmp_path / "run"
    summary = run(*tiny_args(verifier_dir, out, "--dflash.variant=dflash2", "--dflash.conv_group_size=8",
                             "--dflash.selector_rank=8", "--dflash.selector_top_k=4", "--train.max_steps=2",
                             "--consistency.num_prompts=1"))
    train = [r for r in records(out) if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["train/loss"]) for r in train)
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 4
    drafter = load_dflash(out / "drafter", Verifier.from_pretrained(verifier_dir))
    assert isinstance(drafter, DFlash2Drafter) and drafter.cfg.selector_rank == 8
    assert summary["steps"] == 2 and summary["consistency"]["new_tokens"] > 0
