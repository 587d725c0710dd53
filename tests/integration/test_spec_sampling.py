"""Speculative sampling is lossless: the first two generated tokens are distributed exactly as the verifier's own
sampling would give, for chains and trees, with a poor drafter so that rejections really happen (chi-square).

The fast tests run the acceptance functions on real model logits: a 16-token vocabulary makes every context up to
two tokens past the prompt enumerable, so all logits come from two batched forwards and 30k samples are one
vectorised call. The slow test goes end to end through `SpeculativeDecoder.generate`.
"""

import pytest
import torch

from draftheads.eval import SpeculativeDecoder
from draftheads.eval.drafters import make_drafter
from draftheads.eval.drafters.sampling import pick_children
from draftheads.eval.engine.acceptance import accept, probs_from_logits, sample
from draftheads.eval.engine.protocol import Sampling
from draftheads.eval.engine.tree import Tree
from draftheads.models.verifier import Verifier
from tests.utils import chi2_pvalue, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

V = 16
PROMPT = [3, 7, 1, 9]


@pytest.fixture(scope="module")
def models():
    verifier = tiny_model("llama", seed=0, vocab_size=V, num_layers=2, initializer_range=0.2)
    drafter = tiny_model("llama", seed=5, vocab_size=V, num_layers=1, initializer_range=0.5)  # unrelated: poor
    return verifier, drafter


def context_logits(model):
    """Logits after PROMPT, PROMPT+x and PROMPT+x+y: (V,), (V, V), (V, V, V)."""
    with torch.no_grad():
        z0 = model(torch.tensor([PROMPT])).logits[0, -1]
        one = torch.tensor([PROMPT + [x] for x in range(V)])
        z1 = model(one).logits[:, -1]
        two = torch.tensor([PROMPT + [x, y] for x in range(V) for y in range(V)])
        z2 = model(two).logits[:, -1].view(V, V, V)
    return z0, z1, z2


def expected_joint(z0, z1, temperature, top_p):
    q0 = probs_from_logits(z0.double(), temperature, top_p)
    q1 = probs_from_logits(z1.double(), temperature, top_p)
    return q0[:, None] * q1  # (V, V)


def first_two_tokens(tokens, acc, z1, sampling):
    """The step's first two output tokens; when it yields one, the second is the next step's first token, which
    (by the same losslessness, checked on the first token) is a direct sample after the first."""
    B = tokens.shape[0]
    nodes = torch.cat([torch.zeros(B, 1, dtype=torch.long), tokens], 1)
    a = acc.num_accepted
    at = nodes.gather(1, acc.path)  # (B, D+1) tokens along the path
    x1 = torch.where(a >= 1, at[:, 1], acc.next_token)
    direct = sample(probs_from_logits(z1[x1], sampling.temperature, sampling.top_p), sampling.generator)
    x2 = torch.where(a >= 2, at[:, 2], torch.where(a == 1, acc.next_token, direct))
    return x1, x2


@pytest.mark.parametrize("shape", ["chain", "tree", "tree-topk", "chain-deterministic"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.8)])
def test_first_two_tokens_follow_the_verifier(models, shape, temperature, top_p):
    verifier, drafter = models
    z0, z1, z2 = context_logits(verifier)
    w0, w1, _ = context_logits(drafter)
    B = 30000
    sampling = Sampling(temperature, top_p, torch.Generator().manual_seed(11))
    mode = "topk" if shape in ("tree-topk", "chain-deterministic") else "sample"
    branching = [1, 1] if shape.startswith("chain") else [3, 2]
    tree = Tree.from_branching(branching)
    # Depth 1: children of the root; depth 2: children of each depth-1 node (drafter logits after it).
    c1, p1 = pick_children(w0.expand(B, 1, V), branching[0], sampling, mode)  # (B, 1, k1)
    c1 = c1[:, 0]
    c2, p2 = pick_children(w1[c1], branching[1], sampling, mode)  # (B, k1, k2)
    tokens = torch.cat([c1, c2.flatten(1)], 1)  # breadth-first, as Tree.from_branching numbers nodes
    probs = None if p1 is None else torch.cat([p1[:, 0], p2.flatten(1, 2)], 1)
    parent_tok = c1.repeat_interleave(branching[1], dim=1)  # (B, k1*k2)
    logits = torch.cat([z0.expand(B, 1, V), z1[c1], z2[parent_tok, c2.flatten(1)]], 1)  # (B, N+1, V) by node
    acc = accept(tokens, tree, probs, logits, temperature, top_p, sampling.generator)
    x1, x2 = first_two_tokens(tokens, acc, z1, sampling)
    counts = torch.bincount(x1 * V + x2, minlength=V * V)
    assert chi2_pvalue(counts, expected_joint(z0, z1, temperature, top_p)) > 0.001
    # The drafter is poor: its first proposal is rejected often.
    first_rejected = ((acc.num_accepted == 0) | (acc.path[:, 1] != 1)).float().mean()
    assert first_rejected > 0.3, first_rejected


@pytest.mark.parametrize("first_token", ["draft", "prefill"])
@pytest.mark.parametrize("options", [dict(num_draft_tokens=3), dict(branching=[3, 2])], ids=["chain", "tree"])
def test_generate_samples_like_the_verifier(models, options, first_token):
    """End to end: batches of the same prompt through `generate` at T=1; joint of the first two new tokens (with
    first_token="prefill" the first is the prefill's own sample, the second the first verification step's)."""
    verifier, drafter = models
    z0, z1, _ = context_logits(verifier)
    v = Verifier(verifier)
    dec = SpeculativeDecoder(v, make_drafter("draft-model", v, draft=drafter, **options), "draft-model",
                             first_token=first_token)
    counts = torch.zeros(V * V, dtype=torch.long)
    rates = []
    for seed in range(4):
        out = dec.generate([PROMPT] * 2500, 2, temperature=1.0, seed=seed, eos_token_id=None)
        pairs = torch.tensor(out.output_ids)
        counts += torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
        rates.append(out.stats.acceptance_rate)
    assert chi2_pvalue(counts, expected_joint(z0, z1, 1.0, 1.0)) > 0.001
    assert sum(rates) / len(rates) < 0.5  # a poor drafter: most draft tokens rejected


def test_seed_reproducible(models):
    verifier, drafter = models
    v = Verifier(verifier)
    dec = SpeculativeDecoder(v, make_drafter("draft-model", v, draft=drafter, branching=[2, 2]), "draft-model")
    a = dec.generate([PROMPT, PROMPT[:2]], 12, temperature=1.0, seed=3).output_ids
    b = dec.generate([PROMPT, PROMPT[:2]], 12, temperature=1.0, seed=3).output_ids
    c = dec.generate([PROMPT, PROMPT[:2]], 12, temperature=1.0, seed=4).output_ids
    assert a == b and a != c
