"""The decoder end to end: greedy output equals the verifier's plain greedy decoding, for every method, chain and
tree, batch 1 and ragged batch 3; KV rollback leaves exactly the accepted tokens; EOS and errors."""

import functools

import pytest
import torch

from draftheads.eval import Draft, Drafter, SpeculativeDecoder, Tree, build_decoder
from draftheads.eval.drafters import make_drafter
from draftheads.eval.drafters.ngram import ngram_lookup
from draftheads.eval.engine.protocol import Sampling
from draftheads.models.verifier import Verifier
from tests.utils import FAMILIES, hf_greedy, noisy_copy, peaked_model, peaked_with_references, save_tiny_verifier

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_NEW = 24
PROMPTS = {1: [[5, 77, 31, 200, 9, 77, 31]], 3: [[5, 77, 31, 200, 9, 77, 31], [42], [8, 8, 120, 3, 64, 19, 250, 7,
                                                                                     120, 3, 64]]}
METHODS = {
    "autoregressive": lambda m: dict(method="autoregressive"),
    "ngram": lambda m: dict(method="ngram", num_draft_tokens=4),
    "draft-chain": lambda m: dict(method="draft-model", draft=noisy_copy(m, 0.1), num_draft_tokens=4),
    "draft-tree": lambda m: dict(method="draft-model", draft=noisy_copy(m, 0.1), branching=[3, 2, 1]),
    "self-draft": lambda m: dict(method="draft-model", draft=m, num_draft_tokens=3),  # everything accepted
}


@pytest.fixture(scope="module")
def family_setup():
    """Per family: the peaked verifier, and HF greedy references for every prompt."""
    return functools.cache(lambda family: peaked_with_references(family, [p for ps in PROMPTS.values() for p in ps],
                                                                 MAX_NEW))


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate(family_setup, family, method):
    model, verifier, refs = family_setup(family)
    options = METHODS[method](model)
    name = options.pop("method")
    draft = options.pop("draft", None)
    dec = SpeculativeDecoder(verifier, make_drafter(name, verifier, draft, **options), name)
    for batch, prompts in PROMPTS.items():
        out = dec.generate(prompts, MAX_NEW)
        assert out.output_ids == [refs[tuple(p)] for p in prompts], (family, method, batch)
        stats = out.stats
        assert stats.new_tokens == [len(o) for o in out.output_ids]
        assert all(len(row) >= 1 for row in stats.accepted)
        assert [sum(a + 1 for a in row) >= n for row, n in zip(stats.accepted, stats.new_tokens)]
    if method == "self-draft":
        assert stats.tau > 3.0  # a drafter that is the verifier gets (nearly) everything accepted
    if method == "autoregressive":
        assert stats.tau == 1.0 and stats.draft_tokens == 0


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("family", FAMILIES)
def test_first_token_from_the_prefill_changes_nothing_but_the_counts(family_setup, family, method):
    """first_token="prefill" (vLLM's convention): the prefill runs the whole prompt and picks the first token, so
    outputs are plain greedy decoding again, and every verifier call comes after that first token."""
    model, verifier, refs = family_setup(family)
    options = METHODS[method](model)
    name = options.pop("method")
    draft = options.pop("draft", None)
    dec = SpeculativeDecoder(verifier, make_drafter(name, verifier, draft, **options), name, first_token="prefill")
    for batch, prompts in PROMPTS.items():
        out = dec.generate(prompts, MAX_NEW, eos_token_id=None)
        assert out.output_ids == [refs[tuple(p)] for p in prompts], (family, method, batch)
        # the first token is no verifier call's: the steps account for all the others
        assert all(sum(a + 1 for a in row) >= n - 1 for row, n in zip(out.stats.accepted, out.stats.new_tokens))
        assert out.stats.prefill_calls == 1
    assert SpeculativeDecoder(verifier, first_token="prefill").generate(PROMPTS[3], 1).output_ids == \
        [refs[tuple(p)][:1] for p in PROMPTS[3]]  # one token: the prefill's alone, no verification step
    with pytest.raises(ValueError, match="first_token='first': expected one of draft, prefill"):
        SpeculativeDecoder(verifier, first_token="first")


def test_some_drafts_accepted_some_rejected(family_setup):
    """The greedy grid above is not trivial: the noisy draft model is accepted part of the time."""
    model, verifier, _ = family_setup("llama")
    for options in (dict(num_draft_tokens=4), dict(branching=[3, 2, 1])):
        dec = SpeculativeDecoder(verifier, make_drafter("draft-model", verifier, noisy_copy(model, 0.1), **options))
        stats = dec.generate(PROMPTS[3], MAX_NEW, eos_token_id=None).stats
        assert 1.3 < stats.tau < 4.0, stats.tau


def test_from_pretrained_with_folders(tiny_verifier_dirs, tmp_path):
    """Names/folders resolve through Verifier.from_pretrained, for the verifier and for the draft model."""
    draft_dir = save_tiny_verifier(tmp_path / "draft", "llama", seed=3, num_layers=1)
    dec = build_decoder(tiny_verifier_dirs["llama"], draft=str(draft_dir), method="draft-model",
                                             num_draft_tokens=3)
    ref = hf_greedy(dec.verifier.model, PROMPTS[1][0], 12, eos_token_id=2)
    assert dec.generate(torch.tensor(PROMPTS[1]), 12).output_ids == [ref]
    auto = SpeculativeDecoder.from_pretrained(str(tiny_verifier_dirs["qwen2"]))
    assert auto.method == "autoregressive"


# ---- KV rollback -------------------------------------------------------------------------------------------------
class ScriptedDrafter(Drafter):
    """Proposes fixed tokens, one list per step (a stub that pins where the verifier rejects)."""

    name = "scripted"

    def __init__(self, steps: list[list[int]], tree: Tree):
        self.steps, self.tree, self.i = steps, tree, 0
        self.num_draft_tokens, self.max_depth = tree.num_nodes - 1, tree.max_depth

    def propose(self, state, sampling):
        tokens = torch.tensor([self.steps[self.i]])
        self.i += 1
        return Draft(tokens, self.tree)


def assert_cache_holds(dec, model, ids: list[int]):
    """Slots 0..len-1 of every layer equal a fresh HF forward over exactly these tokens."""
    with torch.no_grad():
        fresh = model(torch.tensor([ids]), use_cache=True).cache
    for i, layer in enumerate(fresh.layers):
        torch.testing.assert_close(dec.cache.keys[i][:, :, : len(ids)], layer.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(dec.cache.values[i][:, :, : len(ids)], layer.values, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_kv_rollback(shape):
    """10-token prefix, 5 drafts, rejection at draft 3: the cache holds the prefix + the 2 accepted drafts, the
    corrected token is the next root; the next step writes it to the cache and reads it."""
    model = peaked_model("llama")
    verifier = Verifier(model)
    prompt = [5, 77, 31, 200, 9, 140, 31, 18, 250, 61]
    g = hf_greedy(model, prompt, 6)
    wrong = [(t + 1) % 256 for t in g]
    if shape == "chain":
        tree = Tree.chain(5)
        steps = [[g[0], g[1], wrong[2], g[3], g[4]], [wrong[3]] * 5]
    else:  # root -> {1, 2}; 1 -> {3}; 2 -> {4, 5}: the greedy path goes through the second child twice
        tree = Tree.from_parents(torch.tensor([-1, 0, 0, 1, 2, 2]))
        steps = [[wrong[0], g[0], g[1], wrong[1], g[1]], [wrong[3]] * 5]
        # node 1 (wrong) rejected, node 2 = g0 accepted; its children 4 (wrong) and 5 (g1): 5 accepted
    dec = SpeculativeDecoder(verifier, ScriptedDrafter(steps, tree))
    sampling = Sampling()
    with torch.inference_mode():
        state = dec.begin([prompt], 6, sampling)
        assert state.lengths_host == [9]  # the prompt's last token is the first root
        rows = dec.step(state, sampling)  # per row: [accepted, root, accepted tokens..., next token]
        assert [r[0] for r in rows] == [2] and [r[-1] for r in rows] == [g[2]]
        assert state.lengths_host == [10 + 2]
        assert state.tokens[0, :13].tolist() == prompt + g[:3]  # committed + the corrected root
        assert_cache_holds(dec, model, prompt + g[:2])
        rows = dec.step(state, sampling)  # all rejected: one token, the root g2 enters the cache
        assert [r[0] for r in rows] == [0] and [r[-1] for r in rows] == [g[3]]
        assert state.lengths_host == [13]
        assert_cache_holds(dec, model, prompt + g[:3])


# ---- EOS, stats, errors ------------------------------------------------------------------------------------------
def test_eos_stops_each_row(family_setup):
    model, verifier, _ = family_setup("llama")
    prompts = PROMPTS[3]
    plain = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    eos = plain[0][5]  # a token row 0 emits mid-way
    dec = SpeculativeDecoder(verifier, make_drafter("draft-model", verifier, model, num_draft_tokens=4))
    out = dec.generate(prompts, MAX_NEW, eos_token_id=eos)
    assert out.output_ids == [hf_greedy(model, p, MAX_NEW, eos_token_id=eos) for p in prompts]
    assert out.output_ids[0][-1] == eos and len(out.output_ids[0]) <= 6
    assert dec.generate(prompts, MAX_NEW, eos_token_id=None).output_ids == plain
    assert dec.generate(prompts, 0).output_ids == [[], [], []]
    assert [len(o) for o in dec.generate(prompts, 1, eos_token_id=None).output_ids] == [1, 1, 1]


def test_stats_add_up(family_setup):
    model, verifier, _ = family_setup("qwen2")
    dec = SpeculativeDecoder(verifier, make_drafter("ngram", verifier, num_draft_tokens=3))
    stats = dec.generate(PROMPTS[3], 16, eos_token_id=None).stats
    assert stats.verifier_calls == max(len(r) for r in stats.accepted)
    assert stats.draft_tokens == 3 * sum(len(r) for r in stats.accepted)
    assert stats.new_tokens == [16, 16, 16]
    assert 0 <= stats.acceptance_rate <= 1 and 1 <= stats.tau <= 4
    assert stats.time_total_s >= stats.time_verify_s + stats.time_draft_s
    pos = stats.per_position_acceptance(3)
    assert len(pos) == 3 and all(x >= y for x, y in zip(pos, pos[1:]))
    d = stats.to_dict()
    assert d["tau"] == stats.tau and d["accepted"] == stats.accepted


def test_ngram_lookup():
    #            0  1  2  3  4  5  6  7
    ctx = torch.tensor([[1, 2, 3, 4, 9, 2, 3, 0, 0],     # "2 3" seen before, followed by 4 9 2 3
                        [5, 6, 5, 6, 5, 0, 0, 0, 0],     # period 2: 6 5 6 5
                        [7, 8, 9, 0, 0, 0, 0, 0, 0]])    # no match: the root repeated
    lengths = torch.tensor([6, 4, 2])
    out = ngram_lookup(ctx, lengths, k=4, max_ngram=3, min_ngram=1, window=9)
    assert out.tolist() == [[4, 9, 2, 3], [6, 5, 6, 5], [9, 9, 9, 9]]


def test_errors(family_setup):
    _, verifier, _ = family_setup("llama")
    with pytest.raises(ValueError, match="unknown method 'beam'"):
        make_drafter("beam", verifier)
    with pytest.raises(ValueError, match="no option.*num_drafts"):
        make_drafter("ngram", verifier, num_drafts=3)
    with pytest.raises(ValueError, match="needs draft="):
        make_drafter("draft-model", verifier)
    with pytest.raises(ValueError, match="'medusa' needs draft="):
        make_drafter("medusa", verifier)
    with pytest.raises(ValueError, match="'eagle' needs draft="):
        make_drafter("eagle", verifier)
    dec = SpeculativeDecoder(verifier)
    with pytest.raises(ValueError, match="row 1 is empty"):
        dec.generate([[1, 2], []], 4)
    with pytest.raises(ValueError, match="row 0 has token ids \\[999\\]"):
        dec.generate([[1, 999]], 4)
    with pytest.raises(ValueError, match="temperature"):
        dec.generate([[1, 2]], 4, temperature=-1.0)


# ---- what drafters are told --------------------------------------------------------------------------------------
class RecordingDrafter(Drafter):
    """Wraps a drafter, asks for every verifier output, and keeps a copy of each Committed it is shown."""

    def __init__(self, inner: Drafter, layer_ids=(0, 2)):
        self.inner, self.records = inner, []
        self.num_draft_tokens, self.max_depth = inner.num_draft_tokens, inner.max_depth
        self.layer_ids, self.wants_final, self.wants_logits = tuple(layer_ids), True, True

    def start(self, state, sampling):
        self.inner.start(state, sampling)

    def observe(self, state, committed):
        self.records.append({k: (v.clone() if torch.is_tensor(v) else
                                 {i: h.clone() for i, h in v.items()} if isinstance(v, dict) else v)
                             for k, v in vars(committed).items()})
        self.inner.observe(state, committed)

    def propose(self, state, sampling):
        return self.inner.propose(state, sampling)


def test_committed_carries_the_verifiers_outputs(family_setup):
    """Prefill and every step: the committed tokens, the token after each, and the verifier's post-norm hidden
    states, layer inputs and logits at those positions, as a fresh HF forward over the final text gives them."""
    model, verifier, _ = family_setup("llama")
    inner = make_drafter("draft-model", verifier, noisy_copy(model, 0.1), branching=[2, 2, 1])
    rec = RecordingDrafter(inner)
    dec = SpeculativeDecoder(verifier, rec)
    prompts = PROMPTS[3]
    out = dec.generate(prompts, 12, eos_token_id=None)
    assert any(a > 0 for row in out.stats.accepted for a in row)
    for b, prompt in enumerate(prompts):
        # The last step may commit a few tokens past max_new_tokens: compare against a longer greedy text.
        seq = prompt + hf_greedy(model, prompt, 12 + 6)
        assert seq[: len(prompt) + 12] == prompt + out.output_ids[b]
        with torch.no_grad():
            hf = model(torch.tensor([seq]), output_hidden_states=True)
        final, layers, logits = hf.hidden_states[-1][0], hf.hidden_states, hf.logits[0]
        covered = []
        for r in rec.records:
            n, s = int(r["count"][b]), int(r["start"][b])
            covered += list(range(s, s + n))
            assert r["tokens"][b, :n].tolist() == seq[s: s + n]
            assert r["next_tokens"][b, :n].tolist() == seq[s + 1: s + n + 1]
            torch.testing.assert_close(r["final"][b, :n], final[s: s + n], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(r["logits"][b, :n], logits[s: s + n], atol=2e-5, rtol=1e-4)
            for i in (0, 2):
                torch.testing.assert_close(r["layers"][i][b, :n], layers[i][0, s: s + n], atol=2e-5, rtol=1e-4)
        # Every token went through the verifier exactly once, in order, up to the last root.
        assert covered == list(range(len(covered))) and len(covered) >= len(prompt) + 11
