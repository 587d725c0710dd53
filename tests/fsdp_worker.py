"""One process of tests/e2e/test_fsdp.py, started by `torchrun --nproc_per_node 2` (gloo, CPU).

    torchrun --nproc_per_node 2 tests/fsdp_worker.py VERIFIER_DIR OUT_DIR

Every rank runs the same checks with the same data; rank r writes OUT_DIR/rank{r}.json ({check: value}) and the
test asserts on them. Everything sharded here is sharded by plain torch FSDP2 (`fully_shard`), because Accelerate
refuses FSDP without GPUs: `train.placement.fully_shard_verifier` (what `shard_verifier` calls under an FSDP launch
config) and, for the drafter, `fully_shard` on the module a trainer prepares, as Accelerate's FSDP2 with
`NO_WRAP` does. The Accelerator is a real one (gloo, MULTI_CPU); `train.placement.unsharded` decides by the DTensor
parameters, not by the launch config, so it takes the same path here as under `accelerate launch` with fsdp.yaml.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from draftheads.eval.measure.consistency import check_export  # noqa: E402
from draftheads.models.eagle import EagleConfig, EagleTrainModule, build_drafter  # noqa: E402
from draftheads.models.export import export_eagle
from draftheads.models.medusa import MedusaConfig, MedusaHeads  # noqa: E402
from draftheads.models.verifier import Verifier  # noqa: E402
from draftheads.train.config import RunConfig  # noqa: E402
from draftheads.train.finish import check_exported_drafter, heldout_prompts  # noqa: E402
from draftheads.train.medusa import HeadsObjective  # noqa: E402
from draftheads.train.placement import fully_shard_verifier, is_sharded, unsharded  # noqa: E402

STEPS, B, T = 3, 2, 24


def batches(vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1)  # the same batches on every rank
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (B, T), generator=generator)
        mask = torch.ones(B, T, dtype=torch.long)
        out.append({"input_ids": ids, "attention_mask": mask, "loss_mask": mask.clone()})
    return out


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def train_eagle(verifier: Verifier, data: list[dict], shard_drafter: bool = False):
    """A few AdamW steps of an EAGLE-3 drafter on `verifier`'s online features; returns the prepared module."""
    torch.manual_seed(0)
    cfg = EagleConfig(version=3, layer_ids=[0, 1, 3], draft_vocab_size=None, ttt_steps=2)
    model = EagleTrainModule(build_drafter(verifier, cfg))
    if shard_drafter:
        fully_shard(model)  # what Accelerate's FSDP2 does to the prepared module with NO_WRAP
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for batch in data:
        feats = verifier.features(batch["input_ids"], batch["attention_mask"], layer_ids=cfg.layer_ids)
        model(batch["input_ids"], feats, batch["loss_mask"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, cfg


def train_medusa(verifier: Verifier, data: list[dict]) -> dict:
    torch.manual_seed(0)
    cfg = MedusaConfig(num_heads=2)
    model = HeadsObjective(MedusaHeads.from_config(cfg, verifier), cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in data:
        model(verifier.features(batch["input_ids"], batch["attention_mask"]), batch)[0].backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(verifier_dir: str, out_dir: str) -> None:
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    out: dict = {"world": accelerator.num_processes}
    whole = Verifier.from_pretrained(verifier_dir)
    sharded = Verifier.from_pretrained(verifier_dir)
    fully_shard_verifier(sharded)
    data = batches(whole.vocab_size)

    # 1. The sharded verifier computes what the whole one does; its layers stay sharded between forwards.
    q = sharded.layers[0].self_attn.q_proj.weight
    out["layer_param_is_dtensor"] = isinstance(q, DTensor)
    out["layer_local_rows"] = q.to_local().shape[0]
    out["layer_full_rows"] = whole.layers[0].self_attn.q_proj.weight.shape[0]
    out["whole_kept"] = [type(m.weight).__name__ for m in (sharded.embed_tokens, sharded.norm, sharded.lm_head)]
    ids = data[0]["input_ids"]
    a = whole.features(ids, layer_ids=[0, 1, 3], return_logits=True)
    b = sharded.features(ids, layer_ids=[0, 1, 3], return_logits=True)
    out["features_max_diff"] = max([(a.final - b.final).abs().max().item(), (a.logits - b.logits).abs().max().item(),
                                    *((x - y).abs().max().item() for x, y in zip(a.layers, b.layers))])
    out["resharded_after_forward"] = all(isinstance(p, DTensor) for p in sharded.layers.parameters())

    # 2. Drafters trained on the sharded verifier end with the weights they get on the whole one.
    eagle_whole, ecfg = train_eagle(whole, data)
    eagle_sharded, _ = train_eagle(sharded, data)
    out["eagle_train_max_diff"] = max_difference(eagle_whole.state_dict(), eagle_sharded.state_dict())
    out["medusa_train_max_diff"] = max_difference(train_medusa(whole, data), train_medusa(sharded, data))

    # 3. A sharded drafter (FSDP2), trained on the sharded verifier: `unsharded` gathers it whole, and its export
    #    equals the export of the same training without any sharding.
    eagle_fsdp, _ = train_eagle(sharded, data, shard_drafter=True)
    out["drafter_was_sharded"] = is_sharded(eagle_fsdp)
    full = unsharded(accelerator, eagle_fsdp, lambda: EagleTrainModule(build_drafter(whole, ecfg)))
    out["unsharded_is_plain"] = not is_sharded(full)
    root = Path(out_dir)
    export_dir = root / "eagle-sharded"
    if accelerator.is_main_process:
        export_eagle(full.drafter, export_dir, whole)
        export_eagle(eagle_whole.drafter, root / "eagle-whole", whole)
    accelerator.wait_for_everyone()

    # 4. The train/serve check with the sharded verifier: every process decodes, in lockstep.
    cfg = RunConfig(verifier=verifier_dir, output_dir=str(root / "run"))
    cfg.consistency.num_prompts, cfg.consistency.max_new_tokens = 2, 8
    if accelerator.is_main_process:
        export_eagle(full.drafter, cfg.drafter_dir, whole)
    heldout = [{"input_ids": batch["input_ids"][0], "attention_mask": batch["attention_mask"][0]} for batch in data]
    checked = check_exported_drafter(accelerator, cfg, full.drafter, sharded, heldout, tokenizer=None,
                                     say=lambda message: None)
    out["check_tau"] = None if checked is None else checked.tau_export
    if accelerator.is_main_process:  # the same check against the whole verifier, main process alone
        prompts, _ = heldout_prompts(heldout, None, 2, cfg.consistency.prompt_tokens)
        out["check_tau_whole"] = check_export(full.drafter, cfg.drafter_dir, whole, prompts, max_new_tokens=8).tau_export
    (root / f"rank{rank}.json").write_text(json.dumps(out))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    import gc
    gc.collect()  # as train/cli.main_guard does: the wrapped models and their process group freed before exit
