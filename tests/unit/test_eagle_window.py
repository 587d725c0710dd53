"""eagle.sliding_window: the EAGLE-3 drafter trained and run with a sliding window counted as vLLM counts it (W
positions, the query's own included). The TTT unroll against full attention where the window covers the row (loss
and gradients, fp32, 1e-5 relative) and against a slow per-position reference where it does not; the unroll's chains
against drafting with the windowed KV cache (what the engine and vLLM do); the config key and the export layouts."""

import json
import math

import pytest
import torch

from draftheads.models.eagle import EagleConfig, EagleError, build_drafter
from draftheads.models.export import check_eagle_engine, export_eagle, load_eagle
from draftheads.models.layouts.folder import DrafterFormatError
from draftheads.models.verifier import Verifier
from tests.utils import unsettle_norms_and_biases

T = 12


@pytest.fixture(scope="module")
def verifier(tiny_verifier_dirs):
    return Verifier.from_pretrained(tiny_verifier_dirs["llama"])


def make(verifier, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = EagleConfig(version=3, draft_vocab_size=None, ttt_steps=overrides.pop("ttt_steps", 4), **overrides)
    return unsettle_norms_and_biases(build_drafter(verifier, cfg)).eval()


def batch(verifier, drafter, B=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, verifier.vocab_size, (B, T), generator=g)
    return ids, verifier.features(ids, layer_ids=drafter.feature_layers, return_logits=True)


def with_window(drafter, window):
    """The same weights with eagle.sliding_window = `window`."""
    drafter.cfg.sliding_window = window
    return drafter


def loss_and_grads(drafter, ids, feats, loss_mask):
    drafter.zero_grad()
    loss = drafter.training_loss(ids, feats, loss_mask).loss
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in drafter.parameters() if p.grad is not None]


def test_a_window_that_covers_the_row_trains_as_full_attention(verifier):
    """W = T + ttt_steps: the loss and every gradient equal full attention's (fp32, 1e-5 relative)."""
    drafter = make(verifier).train()
    ids, feats = batch(verifier, drafter)
    loss_mask = torch.ones_like(ids)
    full = loss_and_grads(drafter, ids, feats, loss_mask)
    covered = loss_and_grads(with_window(drafter, T + 4), ids, feats, loss_mask)
    short = loss_and_grads(with_window(drafter, 3), ids, feats, loss_mask)
    for a, b in zip(covered, full):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5
    assert (short[0] - full[0]).abs() > 1e-4  # a window inside the row changes the loss: the check can fail


def slow_windowed_ttt(drafter, ids, hidden, steps, window):
    """The TTT unroll by hand, one query at a time: step k at stream position t (position t+k) attends to the
    step-0 keys s and the chain keys of steps 1..k at t (positions t+1..t+k) whose position is within `window`."""
    B, T_ = ids.shape
    groups = drafter.num_heads // drafter.num_kv_heads
    positions = torch.arange(T_).expand(B, T_)
    keys, values, outs = [], [], []
    for k in range(steps):
        ids_k = torch.zeros_like(ids)
        ids_k[:, :T_ - 1 - k] = ids[:, 1 + k:]
        x, residual = drafter._layer_input(drafter.embed(ids_k), hidden)
        q, kk, vv = drafter._qkv(x, positions + k)
        keys.append(kk.repeat_interleave(groups, 1))
        values.append(vv.repeat_interleave(groups, 1))
        attn = torch.zeros(B, drafter.num_heads, T_, drafter.head_dim)
        for t in range(T_):
            at = t + k
            prefix = [s for s in range(t + 1) if at - s < window]
            chain = [j for j in range(1, k + 1) if at - (t + j) < window]
            ks = torch.cat([keys[0][:, :, prefix]] + [keys[j][:, :, t:t + 1] for j in chain], dim=2)
            vs = torch.cat([values[0][:, :, prefix]] + [values[j][:, :, t:t + 1] for j in chain], dim=2)
            scores = torch.einsum("bhd,bhsd->bhs", q[:, :, t], ks) / math.sqrt(drafter.head_dim)
            attn[:, :, t] = torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), vs)
        hidden = drafter._block(attn.transpose(1, 2).reshape(B, T_, -1), residual)
        outs.append(hidden)
    return outs


@pytest.mark.parametrize("window", [1, 3, 5, 9])
def test_windowed_unroll_matches_a_slow_reference(verifier, window):
    """Windows from the query alone (1), shorter than the unroll (3 < 4 steps: the last steps lose chain keys), and
    inside the row."""
    drafter = make(verifier, sliding_window=window)
    ids, feats = batch(verifier, drafter)
    with torch.no_grad():
        hidden = drafter.project_features(feats.layers)
        fast = drafter.ttt_unroll(ids, hidden, steps=4)
        slow = slow_windowed_ttt(drafter, ids, hidden, 4, window)
        full = with_window(make(verifier), None).ttt_unroll(ids, hidden, steps=4)
    for k, (a, b) in enumerate(zip(fast, slow)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"step {k}")
    assert (fast[-1] - full[-1]).abs().max() > 1e-3  # the window matters here


@pytest.mark.parametrize("window", [2, 5])
def test_windowed_unroll_is_what_drafting_with_the_windowed_cache_does(verifier, window):
    """Each TTT chain equals drafting token by token over the KV cache (the step-0 prefix 0..t, then one token a
    step at positions t+1, ...), the window applied by position as vLLM's cache applies it."""
    drafter = make(verifier, sliding_window=window)
    ids, feats = batch(verifier, drafter)
    steps = 4
    with torch.no_grad():
        hidden = drafter.project_features(feats.layers)
        ttt = drafter.ttt_unroll(ids, hidden, steps=steps)
        ids_in = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        out0, (k0, v0) = drafter(ids_in, hidden)  # step 0 over the whole prefix, windowed
        torch.testing.assert_close(out0, ttt[0], atol=1e-5, rtol=1e-5)
        for t in range(T - steps):
            cache = (k0[:, :, :t + 1], v0[:, :, :t + 1])
            prev = out0[:, t:t + 1]
            for k in range(1, steps):
                pos = torch.full((ids.shape[0], 1), t + k)
                prev, cache = drafter(ids[:, t + 1 + k:t + 2 + k], prev, pos, past_key_value=cache)
                torch.testing.assert_close(prev[:, 0], ttt[k][:, t], atol=1e-5, rtol=1e-5,
                                           msg=f"chain from t={t}, step {k}")


def test_packed_rows_with_a_window_stay_inside_their_document(verifier):
    """Two documents packed in a row, windowed, equal each document run alone with the same window."""
    drafter = make(verifier, sliding_window=4)
    ids, feats = batch(verifier, drafter, B=1)
    cut = 7
    positions = torch.cat([torch.arange(cut), torch.arange(T - cut)])[None]
    with torch.no_grad():
        hidden = drafter.project_features(feats.layers)
        packed = drafter.ttt_unroll(ids, hidden, positions, steps=3)
        first = drafter.ttt_unroll(ids[:, :cut], hidden[:, :cut], steps=3)
        second = drafter.ttt_unroll(ids[:, cut:], hidden[:, cut:], steps=3)
    for k in range(3):
        n = cut - 1 - k  # positions whose step-k input token is still in the first document
        torch.testing.assert_close(packed[k][:, :n], first[k][:, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed[k][:, cut:T - 1 - k], second[k][:, :T - cut - 1 - k], atol=1e-5,
                                   rtol=1e-5)


def test_the_config_key():
    assert EagleConfig().sliding_window is None
    assert EagleConfig(sliding_window=4096).sliding_window == 4096
    for bad in (0, -3, 2.5, True):
        with pytest.raises(EagleError, match=r"eagle.sliding_window=.*expected a whole number of positions >= 1"):
            EagleConfig(sliding_window=bad)
    with pytest.raises(EagleError, match="eagle.sliding_window=8 is an EAGLE-3 option; eagle.version is 1"):
        EagleConfig(version=1, sliding_window=8)


def test_the_window_is_written_where_vllm_and_speculators_read_it(verifier, tmp_path):
    drafter = make(verifier, sliding_window=6)
    folder = export_eagle(drafter, tmp_path / "vllm", verifier)
    config = json.loads((folder / "config.json").read_text())
    assert (config["layer_types"], config["sliding_window"]) == (["sliding_attention"], 6)
    assert load_eagle(folder, verifier).cfg.sliding_window == 6
    folder = export_eagle(drafter, tmp_path / "speculators", verifier, engine="speculators")
    layer = json.loads((folder / "config.json").read_text())["transformer_layer_config"]
    assert (layer["layer_types"], layer["sliding_window"]) == (["sliding_attention"], 6)
    assert load_eagle(folder, verifier).cfg.sliding_window == 6
    plain = export_eagle(make(verifier), tmp_path / "plain", verifier)
    assert not {"layer_types", "sliding_window"} & set(json.loads((plain / "config.json").read_text()))


def test_a_window_the_config_and_the_record_disagree_on_is_refused(verifier, tmp_path):
    """vLLM reads config.json's window; a folder whose window is not the one trained is refused when loaded."""
    folder = export_eagle(make(verifier, sliding_window=6), tmp_path / "e", verifier)
    config = json.loads((folder / "config.json").read_text())
    del config["layer_types"]  # vLLM would serve full attention
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterFormatError, match="layer_types is None, but draftheads.eagle.sliding_window is 6"):
        load_eagle(folder, verifier)
    plain = export_eagle(make(verifier), tmp_path / "p", verifier)
    config = json.loads((plain / "config.json").read_text())
    config.update(layer_types=["sliding_attention"], sliding_window=3)  # vLLM would serve a window never trained
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterFormatError, match="layer_types is \\['sliding_attention'\\], but draftheads.eagle"):
        load_eagle(plain, verifier)


def test_sglang_which_reads_no_window_is_refused_at_config_time():
    with pytest.raises(EagleError, match="eagle.sliding_window=6 with engine sglang: .* full attention"):
        check_eagle_engine(EagleConfig(sliding_window=6), "sglang")
    check_eagle_engine(EagleConfig(sliding_window=6), "vllm")
    check_eagle_engine(EagleConfig(sliding_window=6), "speculators")
