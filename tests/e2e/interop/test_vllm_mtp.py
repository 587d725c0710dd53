"""A fine-tuned MTP layer in real vLLM (the CPU build of 0.32 in .venv-vllm, the V1 runner, enforce_eager): the
checkpoint train/mtp.py writes (the verifier's own checkpoint with its MTP layer replaced under the same names) is
served as the target model with `speculative_config={"method": "glm4_moe_mtp", "num_speculative_tokens": 3}`, for
one batch of one prompt and one of three prompts of different lengths:
  - vLLM's greedy outputs equal plain greedy decoding of the verifier;
  - vLLM's accepted drafts, per request and per verification step (and its totals and per-position counters),
    equal our engine's drafting with the same layer (`method mtp`, first token from the prefill as vLLM does).

Why GLM-4.5 (glm4_moe): of the families whose checkpoints ship an MTP layer and whose verifier transformers builds
without remote code, it is the one with ordinary attention, which vLLM's CPU attention runs at any head size >= 32
(DeepSeek-V3's MLA runs on the CPU build only at kv_lora_rank + qk_rope_head_dim = 576; MiMo's verifier needs
remote code in transformers; Qwen3-Next / Qwen3.5's gated delta-net needs Triton kernels). The tiny verifier is
built like tests/integration/test_mtp_finetune.py's (an MoE layer, partial rotary, its own layers' outputs scaled
down so a few steps teach the layer something) and its random shipped MTP layer is fine-tuned until it drafts
right part of the time: mixed accepted counts, so a layer wired or read differently changes them (feeding the next
draft the normed output instead of the raw one fails this test). Not distinguished here: vLLM's zeroed token
embedding at position 0 (our layer zeroes it too, as vLLM's code does; leaving it out changes no draft of these
prompts).
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.interop.test_vllm import PROMPTS
from tests.utils import hf_greedy

pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("one_thread")]

K, MAX_NEW = 3, 32
BATCHES = [PROMPTS[:1], PROMPTS]


def fine_tuned_checkpoint(root, family: str = "glm4_moe"):
    """(the shipped checkpoint, the fine-tuned one written by export_mtp)."""
    from safetensors.torch import load_file, save_file

    from draftheads.models.export import export_mtp
    from draftheads.models.mtp import MtpConfig, build_mtp_drafter
    from draftheads.models.verifier import Verifier
    from tests.utils import save_tiny_mtp_checkpoint

    shipped = save_tiny_mtp_checkpoint(root / family, family)
    tensors = load_file(shipped / "model.safetensors")
    for name in tensors:
        if name.startswith(("model.layers.0.", "model.layers.1.")) and name.endswith(("o_proj.weight",
                                                                                      "down_proj.weight")):
            tensors[name] = tensors[name] * 0.01
    save_file(tensors, shipped / "model.safetensors", metadata={"format": "pt"})
    verifier = Verifier.from_pretrained(shipped)
    gen = torch.Generator().manual_seed(0)
    train = torch.cat([torch.randperm(verifier.vocab_size, generator=gen) for _ in range(2)]).view(16, 32)
    feats = verifier.features(train, return_logits=True)
    torch.manual_seed(0)
    drafter = build_mtp_drafter(verifier, cfg=MtpConfig(steps=2)).train()
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(20):
        opt.zero_grad()
        drafter.train_forward(train, feats.final, torch.ones_like(train), feats.logits.argmax(-1)).loss.backward()
        opt.step()
    return shipped, export_mtp(drafter.eval(), root / f"{family}-tuned", verifier)


FAMILIES = {"glm4_moe": "glm4_moe_mtp"}


@pytest.fixture(scope="module")
def interop(tmp_path_factory, vllm_ready):
    from draftheads.eval import build_decoder
    from draftheads.eval.interop.vllm_peer import VllmCase, run_vllm
    from draftheads.models.verifier import Verifier

    root = tmp_path_factory.mktemp("interop-mtp")
    cases, ours, references = [], {}, {}
    for family, method in FAMILIES.items():
        shipped, tuned = fine_tuned_checkpoint(root, family)
        verifier = Verifier.from_pretrained(tuned)  # the fine-tuned checkpoint is the verifier vLLM serves
        references[family] = {tuple(p): hf_greedy(verifier.model, p, MAX_NEW) for p in PROMPTS}
        dec = build_decoder(verifier, method="mtp", num_draft_tokens=K, first_token="prefill")
        ours[family] = [dec.generate(batch, MAX_NEW, eos_token_id=None) for batch in BATCHES]
        cases.append(VllmCase(family, str(tuned), str(tuned), method, batches=BATCHES, k=K, max_tokens=MAX_NEW))
    result = run_vllm(cases)
    return {"ours": ours, "vllm": {c["name"]: c for c in result["cases"]}, "references": references}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_vllm_serves_the_fine_tuned_mtp_layer_like_our_engine(interop, family):
    vllm = interop["vllm"][family]
    assert vllm["ok"], f"vLLM refused the fine-tuned {family} checkpoint: {vllm.get('error')}\n{vllm.get('traceback')}"
    for batch, ours, theirs in zip(BATCHES, interop["ours"][family], vllm["batches"]):
        want = [interop["references"][family][tuple(p)] for p in batch]
        assert theirs["outputs"] == want, f"{family}: vLLM's output is not plain greedy decoding"
        assert ours.output_ids == want
        assert theirs["per_step_accepted"] == ours.stats.accepted, family  # per request, per verification step
        steps = [a for row in ours.stats.accepted for a in row]
        assert theirs["metrics"]["vllm:spec_decode_num_accepted_tokens"] == sum(steps)
        assert theirs["metrics"]["vllm:spec_decode_num_accepted_tokens_per_pos"] == \
            [sum(a > i for a in steps) for i in range(K)]
        assert theirs["metrics"]["vllm:spec_decode_num_drafts"] == len(steps)
    steps = [a for o in interop["ours"][family] for row in o.stats.accepted for a in row]
    assert sum(steps) >= 10 and sum(a == K for a in steps) >= 2 and sum(a == 0 for a in steps) >= 2, \
        f"{family}: accepted counts {steps}: too uniform for the comparison to mean much"
