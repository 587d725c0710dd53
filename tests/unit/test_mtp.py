"""The MTP layer under the checkpoint's own names (models/layouts/mtp_checkpoint.py, models/mtp/): read, built as the
verifier's decoder-layer class, written back; bad checkpoints refused in one line; the step against a slow
prefix-by-prefix reference."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftheads.models.layouts.mtp_checkpoint import MtpCheckpointError, read_mtp_layer, write_mtp_checkpoint
from draftheads.models.mtp import MtpConfig, MtpError, build_mtp_drafter
from draftheads.models.verifier import Verifier
from tests.utils import save_tiny_mtp_checkpoint, save_tiny_verifier

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    folder = save_tiny_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "glm")
    return folder, Verifier.from_pretrained(folder)


def test_the_layer_reads_and_writes_back_under_the_checkpoints_own_names(glm, tmp_path):
    folder, verifier = glm
    weights = read_mtp_layer(folder)
    assert weights.model_type == "glm4_moe" and weights.layer_index == 2 and weights.method == "glm4_moe_mtp"
    assert "model.layers.2.mlp.experts.3.up_proj.weight" in weights.tensors  # per-expert, as stored
    drafter = build_mtp_drafter(verifier, weights)
    back = drafter.checkpoint_tensors()
    assert set(back) == set(weights.tensors)
    assert all(torch.equal(back[k], weights.tensors[k]) for k in back)  # shipped weights, exactly
    with torch.no_grad():
        drafter.eh_proj.weight.add_(1.0)
        drafter.block.mlp.experts.gate_up_proj[1, -1].add_(1.0)  # expert 1's up_proj, last row
    out = write_mtp_checkpoint(weights, tmp_path / "tuned", drafter.checkpoint_tensors(), {"draftheads": {}})
    written, source = load_file(out / "model.safetensors"), load_file(folder / "model.safetensors")
    changed = {k for k in source if not torch.equal(written[k], source[k])}
    assert changed == {"model.layers.2.eh_proj.weight", "model.layers.2.mlp.experts.1.up_proj.weight"}
    assert set(written) == set(source)
    for name in ("config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes()
    assert json.loads((out / "draftheads_mtp.json").read_text()) == {"draftheads": {}}


def test_a_checkpoint_without_mtp_weights_is_one_line(tmp_path):
    folder = save_tiny_mtp_checkpoint(tmp_path / "glm", mtp=False)
    with pytest.raises(MtpCheckpointError) as err:
        read_mtp_layer(folder)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{folder}: no MTP weights in its safetensors")
    assert "model.layers.2.{enorm.weight," in message


def test_a_family_without_an_mtp_layer_we_fine_tune_is_one_line(tmp_path):
    folder = save_tiny_verifier(tmp_path / "llama", "llama")
    with pytest.raises(MtpCheckpointError) as err:
        read_mtp_layer(folder)
    assert str(err.value) == (f"{folder / 'config.json'}: model_type 'llama' has no MTP layer draftheads fine-tunes; "
                              "expected one of glm4_moe (vLLM methods glm4_moe_mtp)")


def test_write_back_refuses_other_names_or_shapes(glm, tmp_path):
    folder, _ = glm
    weights = read_mtp_layer(folder)
    fewer = dict(weights.tensors)
    fewer.pop("model.layers.2.enorm.weight")
    with pytest.raises(MtpCheckpointError, match="1 missing"):
        write_mtp_checkpoint(weights, tmp_path / "a", fewer, {})
    wrong = {**weights.tensors, "model.layers.2.enorm.weight": torch.ones(3)}
    with pytest.raises(MtpCheckpointError, match=r"model.layers.2.enorm.weight: shape \(3,\)"):
        write_mtp_checkpoint(weights, tmp_path / "b", wrong, {})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_bad_mtp_settings_are_refused():
    with pytest.raises(MtpError, match="mtp.steps=0"):
        MtpConfig(steps=0)
    with pytest.raises(MtpError, match="mtp.step_decay=1.5"):
        MtpConfig(step_decay=1.5)


def test_the_first_draft_equals_a_slow_prefix_by_prefix_reference(glm):
    """Step 0 of the unrolled loss at position p computes what the layer computes over the pairs 0..p alone (what
    vLLM's cached drafting sees), for every p: the full-row forward is causal and position-0 aware."""
    folder, verifier = glm
    drafter = build_mtp_drafter(verifier, cfg=MtpConfig(steps=1)).eval()
    ids = torch.randint(0, verifier.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    final = verifier.features(ids).final
    pos = torch.arange(8)[None]
    with torch.no_grad():
        full = drafter.logits(drafter(ids[:, 1:], final[:, :-1], pos))  # (1, 8, V)
        slow = torch.stack([drafter.logits(drafter(ids[:, 1:p + 2], final[:, :p + 1], pos[:, :p + 1]))[0, -1]
                            for p in range(8)])
        out = drafter.train_forward(ids, final, torch.ones_like(ids), ids)
    torch.testing.assert_close(full[0], slow, atol=1e-5, rtol=1e-5)
    # the loss scores step 0's argmax at p against labels[p + 1] where x_{p+2} is scored: positions 0..6 here
    want = (full[0, :7].argmax(-1) == ids[0, 1:8]).sum()
    assert out.counts.correct[0] == want and out.counts.valid[0] == 7


def test_init_random_starts_the_layer_afresh(glm):
    folder, verifier = glm
    weights = read_mtp_layer(folder)
    torch.manual_seed(0)
    fresh = build_mtp_drafter(verifier, weights, MtpConfig(init="random")).checkpoint_tensors()
    assert set(fresh) == set(weights.tensors)
    assert not torch.equal(fresh["model.layers.2.eh_proj.weight"], weights.tensors["model.layers.2.eh_proj.weight"])
    assert all(torch.isfinite(v).all() for v in fresh.values())
    assert torch.equal(fresh["model.layers.2.enorm.weight"], torch.ones(128))
    # the shared head is never re-initialised: it is the verifier's
    head = "model.layers.2.shared_head.head.weight"
    assert torch.equal(fresh[head], weights.tensors[head])
