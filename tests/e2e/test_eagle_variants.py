"""EAGLE-3's newer variants: parallel drafting (P-EAGLE) and EAGLE 3.1's fc_norm / norm_output.

Parallel drafting: the training unroll equals an uncached forward over the prefix and the mask positions (what
vLLM's parallel drafting runs); the engine's K drafts equal that reference at every step of a real decode; greedy
output equals Hugging Face greedy decoding (Llama, Qwen2, Mistral; batch 1 and ragged 3), in the fused loop too
(CPU, graphs off); sampling at T=1 is lossless (chi-square); the export carries what vLLM's loader reads
(mask_token_id, mask_hidden [3H]) and loads back exactly. EAGLE 3.1: the unroll equals the step-by-step cached
drafting, greedy output is exact, and the export carries fc_norm.{0,1,2} and the two flags.
"""

import functools
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from draftheads.eval import SpeculativeDecoder
from draftheads.eval.drafters import make_drafter
from draftheads.models.eagle import EagleConfig, EagleError, build_drafter
from draftheads.models.export import check_eagle_engine, export_eagle, load_eagle
from draftheads.models.verifier import Verifier
from tests.utils import FAMILIES, fit_eagle, greedy_corpus, peaked_with_references

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW = 24
PROMPTS = [[5, 77, 31, 200, 9, 77, 31], [42], [8, 8, 120, 3, 64, 19, 250, 7, 120, 3, 64]]
VARIANTS = {"parallel": dict(parallel=True), "eagle31": dict(fc_norm=True, norm_output=True)}


def randomise_norms(drafter):
    with torch.no_grad():  # norms away from 1, so a norm applied in the wrong place shows
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return drafter


def fitted(model, verifier, variant, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = PROMPTS + torch.randint(3, model.config.vocab_size, (8, 6), generator=g).tolist()
    drafter = fit_eagle(verifier, 3, greedy_corpus(model, prompts, 32), draft_vocab_size=200, ttt_steps=4,
                        **VARIANTS[variant])
    if variant == "eagle31":
        randomise_norms(drafter)
    return drafter


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    @functools.cache
    def get(family, variant):
        model, verifier, refs = peaked_with_references(family, PROMPTS, MAX_NEW)
        folder = tmp_path_factory.mktemp(f"{variant}-{family}")
        drafter = fitted(model, verifier, variant)
        export_eagle(drafter, folder, verifier)
        return model, verifier, refs, folder, drafter

    return get


# ---- the unroll ------------------------------------------------------------------------------------------------
def reference_parallel(drafter, ids, feats, t, k):
    """Output of mask step k for the chain from stream position t, from scratch: the step-0 pairs at positions
    0..t, then k mask positions t+1..t+k, one causal forward without any cache."""
    h = drafter.project_features(feats.layers)[:, :t + 1]  # (B, t+1, H)
    B = ids.shape[0]
    tokens = torch.cat([F.pad(ids[:, 1:], (0, 1))[:, :t + 1],
                        torch.full((B, k), drafter.mask_token_id)], 1)
    hidden = torch.cat([h, drafter.mask_feature().expand(B, k, -1)], 1)
    out, _ = drafter(tokens, hidden)
    return out[:, t + k]


def random_drafter(verifier_dir, **cfg):
    """A random EAGLE-3 drafter (norms away from 1) for the verifier in `verifier_dir`, two rows of 10 random tokens
    and their verifier features."""
    verifier = Verifier.from_pretrained(verifier_dir)
    torch.manual_seed(0)
    drafter = randomise_norms(build_drafter(verifier, EagleConfig(draft_vocab_size=None, **cfg))).eval()
    ids = torch.randint(3, verifier.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    return drafter, ids, verifier.features(ids, layer_ids=drafter.feature_layers)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_parallel_unroll_is_one_forward_over_prefix_and_masks(tiny_verifier_dirs, family):
    drafter, ids, feats = random_drafter(tiny_verifier_dirs[family], ttt_steps=4, parallel=True, fc_norm=True)
    with torch.no_grad():
        outs = drafter.ttt_unroll(ids, drafter.project_features(feats.layers))
        for t in range(10 - 4):
            for k in range(4):
                torch.testing.assert_close(outs[k][:, t], reference_parallel(drafter, ids, feats, t, k),
                                           atol=1e-5, rtol=1e-5, msg=f"t={t}, step {k}")


def test_eagle31_unroll_is_what_cached_drafting_does(tiny_verifier_dirs):
    """With norm_output the next step reads the normed hidden; the unroll and step-by-step drafting agree."""
    drafter, ids, feats = random_drafter(tiny_verifier_dirs["llama"], ttt_steps=3, fc_norm=True, norm_output=True)
    with torch.no_grad():
        hidden = drafter.project_features(feats.layers)
        # fc_norm: each layer's block normalised before fc
        blocks = [norm(x) for norm, x in zip(drafter.fc_norm, feats.layers)]
        torch.testing.assert_close(hidden, drafter.fc(torch.cat(blocks, -1)))
        torch.testing.assert_close(drafter.project_features(torch.cat(feats.layers, -1)), hidden)
        outs = drafter.ttt_unroll(ids, hidden)
        out0, (k0, v0) = drafter(F.pad(ids[:, 1:], (0, 1)), hidden)
        torch.testing.assert_close(out0, outs[0])
        for t in range(10 - 3):
            cache, prev = (k0[:, :, :t + 1], v0[:, :, :t + 1]), out0[:, t:t + 1]
            for k in range(1, 3):
                prev, cache = drafter(ids[:, t + 1 + k:t + 2 + k], prev, torch.full((2, 1), t + k),
                                      past_key_value=cache)
                torch.testing.assert_close(prev[:, 0], outs[k][:, t], atol=1e-5, rtol=1e-5)
        # norm_output: logits read the hidden as it is (it is already the final norm's output)
        torch.testing.assert_close(drafter.logits(outs[1]), drafter.lm_head(outs[1]))


def test_parallel_training_samples_nested_chains(tiny_verifier_dirs):
    verifier = Verifier.from_pretrained(tiny_verifier_dirs["llama"])
    torch.manual_seed(0)
    cfg = EagleConfig(ttt_steps=4, draft_vocab_size=None, parallel=True, step_weights="uniform")
    drafter = build_drafter(verifier, cfg)
    assert [drafter.keep_fraction(k) for k in range(5)] == pytest.approx([1, 0.7, 0.49, 0.343, 0.2401])
    drafter.cfg.parallel_keep = (0.5, 0.3)
    assert [drafter.keep_fraction(k) for k in range(4)] == pytest.approx([1, 0.5, 0.3, 0.3])
    ids = torch.randint(3, verifier.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    feats = verifier.features(ids, layer_ids=drafter.feature_layers, return_logits=True)
    mask = torch.ones(4, 16)
    drafter.eval()
    full = drafter.training_loss(ids, feats, mask)
    drafter.train()
    drafter.cfg.parallel_keep = (1.0, 1.0)  # keep everything: training mode equals eval mode (no noise in EAGLE-3)
    torch.testing.assert_close(drafter.training_loss(ids, feats, mask).loss, full.loss)
    drafter.cfg.parallel_keep = (0.5, 0.3)
    torch.manual_seed(3)
    a = drafter.training_loss(ids, feats, mask)
    torch.manual_seed(3)
    b = drafter.training_loss(ids, feats, mask)
    torch.testing.assert_close(a.loss, b.loss)  # reproducible from the seed (exact resume)
    torch.testing.assert_close(a.step_losses[0], full.step_losses[0])  # step 0 trains every position
    assert not torch.allclose(a.step_losses[1:], full.step_losses[1:])
    a.loss.backward()
    assert drafter.mask_hidden.grad is not None and drafter.mask_hidden.grad.abs().sum() > 0


def test_variant_config_errors(tiny_verifier_dirs):
    verifier = Verifier.from_pretrained(tiny_verifier_dirs["llama"])
    for key in ("parallel", "fc_norm", "norm_output"):
        with pytest.raises(EagleError, match=f"eagle.{key}=true is an EAGLE-3 option"):
            EagleConfig(version=1, **{key: True})
        with pytest.raises(EagleError, match="engine sglang"):
            check_eagle_engine(EagleConfig(**{key: True}), "sglang")
    with pytest.raises(EagleError, match="engine speculators"):
        check_eagle_engine(EagleConfig(parallel=True), "speculators")
    with pytest.raises(EagleError, match="parallel_keep"):
        EagleConfig(parallel_keep=(0.7, 0))
    with pytest.raises(EagleError, match="mask_token_id=9999"):
        build_drafter(verifier, EagleConfig(parallel=True, mask_token_id=9999, draft_vocab_size=None))
    drafter = build_drafter(verifier, EagleConfig(parallel=True, draft_vocab_size=None))
    assert drafter.mask_token_id == verifier.config.pad_token_id
    with pytest.raises(ValueError, match="chain=0"):
        make_drafter("eagle", verifier, drafter, chain=0)


# ---- decoding --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate(exported, family, variant):
    model, verifier, refs, folder, _ = exported(family, variant)
    dec = SpeculativeDecoder(verifier, make_drafter("eagle", verifier, str(folder), chain=4), "eagle")
    accepted = []
    for prompts in (PROMPTS[:1], PROMPTS):
        out = dec.generate(prompts, MAX_NEW)
        assert out.output_ids == [refs[tuple(p)] for p in prompts], (family, variant, len(prompts))
        accepted += [a for row in out.stats.accepted for a in row]
    assert dec.drafter.parallel == (variant == "parallel")
    assert sum(a > 0 for a in accepted) >= 3, accepted  # the drafter is right part of the time


def test_parallel_drafts_equal_an_uncached_reference_at_every_step(exported):
    """Each step's K drafts are the argmax of one forward, from scratch, over the committed pairs (the verifier's
    features) and K-1 mask positions after them."""
    model, verifier, refs, folder, _ = exported("llama", "parallel")
    drafter = make_drafter("eagle", verifier, str(folder), chain=4)
    m = drafter.model
    seen = []
    propose = drafter.propose

    def record(state, sampling):
        draft = propose(state, sampling)
        seen.append((state.tokens.clone(), state.lengths.clone(), state.active.clone(), draft.tokens.clone()))
        return draft

    drafter.propose = record
    SpeculativeDecoder(verifier, drafter, "eagle").generate(PROMPTS, MAX_NEW)
    assert len(seen) > 5
    with torch.no_grad():
        for tokens, lengths, active, drafts in seen[1:]:
            for b in range(tokens.shape[0]):
                L = int(lengths[b])
                if L < 2 or not active[b]:  # finished rows keep their last drafts
                    continue
                row = tokens[b:b + 1, :L + 1]  # committed tokens and the root
                feats = verifier.features(row[:, :L], layer_ids=m.feature_layers)
                hidden = torch.cat([m.project_features(feats.layers), m.mask_feature().expand(1, 3, -1)], 1)
                ids = torch.cat([row[:, 1:L + 1], torch.full((1, 3), m.mask_token_id)], 1)
                out, _ = m(ids, hidden)
                want = m.to_target_ids(m.logits(out[:, L - 1:]).argmax(-1))[0]
                assert drafts[b].tolist() == want.tolist(), (b, L)


def test_parallel_in_the_fused_loop_equals_the_unfused_loop(exported):
    from draftheads.eval.engine.cuda_loop import Buckets, FusedDecoder

    model, verifier, refs, folder, _ = exported("llama", "parallel")

    def build():
        return SpeculativeDecoder(verifier, make_drafter("eagle", verifier, str(folder), chain=4), "eagle")

    plain, fused = build(), FusedDecoder(build(), graphs=False, buckets=Buckets(batch=(1, 4), capacity=64, window=64))
    for prompts in (PROMPTS[:1], PROMPTS):
        want, got = plain.generate(prompts, MAX_NEW), fused.generate(prompts, MAX_NEW)
        assert got.output_ids == want.output_ids == [refs[tuple(p)] for p in prompts]
        assert got.stats.accepted == want.stats.accepted
    sampled = [d.generate(PROMPTS[:1], MAX_NEW, temperature=0.9, seed=3).output_ids for d in (plain, fused)]
    assert sampled[0] == sampled[1]




# ---- export ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_carries_what_vllm_reads_and_loads_back_exactly(exported, variant):
    model, verifier, refs, folder, drafter = exported("llama", variant)
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    H = verifier.hidden_size
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    if variant == "parallel":
        # vLLM (llm_base_proposer): top-level mask_token_id; llama_eagle3: a `mask_hidden` of 3H elements (fc's input)
        assert config["mask_token_id"] == verifier.config.pad_token_id
        assert tensors["mask_hidden"].shape == (3 * H,)
        assert (config["fc_norm"], config["norm_output"]) == (False, False)
        assert config["draftheads"]["eagle"]["parallel"] is True
    else:
        # vLLM llama_eagle3: top-level booleans; fc_norm a ModuleList of target_hidden_size-wide RMS norms
        assert (config["fc_norm"], config["norm_output"]) == (True, True) and "mask_token_id" not in config
        assert [tuple(tensors[f"fc_norm.{i}.weight"].shape) for i in range(3)] == [(H,)] * 3
        assert "mask_hidden" not in tensors
    loaded = load_eagle(folder, verifier)
    for name, value in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, msg=name)
    if variant == "parallel":
        assert loaded.mask_token_id == drafter.mask_token_id
        torch.testing.assert_close(loaded.mask_feature(), drafter.mask_feature())
