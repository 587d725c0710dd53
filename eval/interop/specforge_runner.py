"""Run SpecForge 0.2's EAGLE-3 trainer on this CPU from offline features, then its SGLang export, and report the
training loop's time and memory.

    SPECFORGE_DEVICE=cpu .venv-specforge/bin/python eval/interop/specforge_runner.py REPORT.json RUN.yaml \
        DRAFT_CONFIG.json EXPORT_DIR

This file runs in the SpecForge environment (scripts/setup_peers.sh), so it imports nothing of draftheads. The run
is `specforge train -c RUN.yaml` then `specforge export --to sglang`, in this process; SpecForge's code is not
changed, three things are replaced at run time, each because its path assumes a GPU or a sharded checkpoint:
  - `specforge.core.loss`: its KL loss is a Triton kernel (no Triton on a CPU); the module is replaced before it is
    imported by one with the same `LogSoftmaxLoss.apply(logits, target_p, position_mask)` computed eagerly, as its
    own reference implementation states it: -sum(position_mask * target_p * log_softmax(logits)) averaged over
    positions (autograd gives the gradient).
  - `TargetHead.load_weights`: it reads lm_head through a sharded checkpoint's *.index.json, which a one-file
    model.safetensors has not; here it reads the tensor from whichever safetensors file holds it.
  - `TargetHead.from_pretrained`: it casts the verifier's head to bf16; here it stays float32, as the features
    and the other trainers are.
Set in the environment by the bench: SPECFORGE_DEVICE=cpu (gloo, CPU tensors), TORCHDYNAMO_DISABLE=1 (its
torch.compile'd helpers run eagerly: inductor would compile C++ for minutes on this CPU). In RUN.yaml:
attention_backend sdpa, fsdp_sharding NO_SHARD, an explicit draft config (its default draft vocabulary is 32000).
REPORT.json gets {seconds (Trainer.fit, wall), cpu_seconds (its process time), peak_rss_mib, export}.
"""

from __future__ import annotations

import json
import resource
import sys
import time
import types


def eager_kl_loss() -> None:
    import torch

    class LogSoftmaxLoss:
        @staticmethod
        def apply(logits, target_p, position_mask):
            logp = torch.log_softmax(logits.float(), dim=-1)
            return -(position_mask * target_p * logp).sum(-1).mean()

    module = types.ModuleType("specforge.core.loss")
    module.LogSoftmaxLoss = LogSoftmaxLoss
    sys.modules["specforge.core.loss"] = module


def float32_target_head() -> None:
    import glob
    import os

    import torch
    from safetensors import safe_open

    from specforge.modeling.target.target_head import TargetHead

    @torch.no_grad()
    def load_weights(self, model_path, lm_head_key="lm_head.weight", cache_dir=None):
        self.model_path = model_path
        for path in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
            with safe_open(path, framework="pt") as f:
                if lm_head_key in f.keys():
                    self.fc.weight.copy_(f.get_tensor(lm_head_key))
                    return
        raise FileNotFoundError(f"no {lm_head_key} in {model_path}/*.safetensors")

    original = TargetHead.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        return original(cls, *args, **kwargs).float()

    TargetHead.load_weights = load_weights
    TargetHead.from_pretrained = classmethod(from_pretrained)


def timed_fit(report: dict) -> None:
    from specforge.training.trainer import Trainer

    original = Trainer.fit

    def fit(self, *args, **kwargs):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            report["seconds"] = time.perf_counter() - t0
            report["cpu_seconds"] = time.process_time() - c0  # every thread of this process

    Trainer.fit = fit


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: specforge_runner.py REPORT.json RUN.yaml DRAFT_CONFIG.json EXPORT_DIR", file=sys.stderr)
        return 2
    out, run_yaml, draft_config, export_dir = argv
    eager_kl_loss()
    float32_target_head()
    report = {"seconds": None}
    timed_fit(report)
    from specforge.cli import main as specforge

    code = specforge(["train", "-c", run_yaml])
    if code:
        return code
    report["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    import yaml

    checkpoint = yaml.safe_load(open(run_yaml))["output_dir"]
    code = specforge(["export", "--to", "sglang", "--checkpoint", checkpoint, "--draft-config", draft_config,
                      "--output-dir", export_dir])
    report["export"] = export_dir
    with open(out, "w") as f:
        json.dump(report, f)
    return code or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
