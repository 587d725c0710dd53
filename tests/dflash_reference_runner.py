"""Runs z-lab's reference DFlash (`dflash` 0.1.0) on a case folder written by tests/e2e/test_dflash_reference.py.
It runs inside .venv-dflash (scripts/setup_dflash_reference.sh) and imports nothing of draftheads.

    .venv-dflash/bin/python tests/dflash_reference_runner.py CASE_DIR

CASE_DIR/drafter/{config.json, model.safetensors}   a DFlashDraftModel (loaded with from_pretrained, strict names)
CASE_DIR/forward.safetensors                        target_hidden, noise_embedding, position_ids
CASE_DIR/target/ + generate.json (optional)         an HF causal LM, {"input_ids", "max_new_tokens", "stop"}
writes CASE_DIR/reference.safetensors: hidden (forward), logits, and with a target output_ids and acceptance_lengths.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main(case: Path) -> None:
    from transformers import AutoModelForCausalLM

    import time

    import dflash.model as reference
    from dflash.model import DFlashDraftModel, dflash_generate

    reference._cuda_time = time.perf_counter  # its stats time with torch.cuda.synchronize(); a CPU build has no CUDA

    model, info = DFlashDraftModel.from_pretrained(case / "drafter", dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"} or info.get("error_msgs")
    if bad:
        raise SystemExit(f"reference: the drafter's weights do not load strictly: {bad}")
    model.eval()
    out = {}
    inputs = load_file(str(case / "forward.safetensors"))
    with torch.no_grad():
        hidden = model(position_ids=inputs["position_ids"], noise_embedding=inputs["noise_embedding"],
                       target_hidden=inputs["target_hidden"])
    out["hidden"] = hidden.contiguous()
    if (case / "target").is_dir():
        target = AutoModelForCausalLM.from_pretrained(case / "target", dtype=torch.float32).eval()
        with torch.no_grad():
            out["logits"] = model.compute_logits(hidden, target.lm_head).contiguous()
        spec = json.loads((case / "generate.json").read_text())
        stats = dflash_generate(model, target, torch.tensor([spec["input_ids"]]), spec["max_new_tokens"],
                                spec.get("stop"), temperature=0.0, return_stats=True)
        out["output_ids"] = stats.output_ids[0].contiguous()
        out["acceptance_lengths"] = torch.tensor(stats.acceptance_lengths, dtype=torch.long)
    save_file(out, str(case / "reference.safetensors"))
    print(json.dumps({"ok": True, "keys": sorted(out)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
