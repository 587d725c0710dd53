"""Acceptance math: which draft tokens the verifier keeps, and the token it adds. Pure functions on tensors.

Every function here is deterministic given its inputs; randomness comes in as explicit tensors so that a slow
reference (tests/integration/test_acceptance.py) and a fused kernel can be checked against these bit for bit:
  uniform (B, N)  one U[0, 1) draw per draft node; node i (1-based) uses uniform[:, i-1]
  noise   (B, V)  Exponential(1) draws for the one final sample: argmax(probs / noise) is a sample from probs
                  (the exponential race, which needs no cumulative sum and no host sync)

Layout, shared with `draftheads.eval.engine.tree`: draft tokens (B, N) are nodes 1..N of a tree whose node 0 is the pending root;
verifier logits / probs (B, N+1, V) are indexed by node (row i = the verifier's next-token distribution after
node i's path); draft probs (B, N, V) are, for node i, the exact distribution node i was drawn from given
everything drawn before it, or None when every draft token is a deterministic pick (one-hot draft distribution:
n-gram, greedy top-k, argmax chains).

Lossless rules (Leviathan et al. 2023, Chen et al. 2023; trees as in SpecInfer / SpecTr):
  chain: accept d_i with prob min(1, q(d_i) / p(d_i)); at the first rejection sample from normalize((q - p)+);
         when all N are accepted, sample a bonus token from q after the last one.
  tree:  at a node, try its children in order; child x with draft distribution p_x is accepted with
         min(1, q(x) / p_x(x)), else q <- normalize((q - p_x)+) and the next child is tried against that q.
         One-hot p_x makes this "q(x) to accept, else zero x out of q". Children drawn without replacement carry
         the renormalised remainder as p_x, which keeps the rule exact. When no child is accepted, sample from
         the current q; when a leaf is accepted, sample the bonus token from the verifier at that leaf.
  greedy: accept while the draft token equals the verifier's argmax at its parent; in a tree keep the deepest
         fully-matching path (ties: the lowest node index); the next token is the argmax after it.

Lossy, by request only: Medusa's typical acceptance (`typical_tree`, Cai et al. 2024; the Medusa repo's
`evaluate_posterior`). A node is kept when the verifier gives its token more than
min(epsilon, alpha * exp(-entropy)) at its parent; the deepest fully-kept path wins (ties: the higher verifier
likelihood), and the next token is sampled from the verifier truncated to that same typical set. It accepts more
than the lossless rules and does NOT sample from the verifier's distribution; at temperature 0 it is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftheads.eval.engine.tree import Tree


@dataclass
class Acceptance:
    """What the verifier keeps from one draft."""

    num_accepted: torch.Tensor
    """(B,) long: accepted draft tokens a, 0..D (the step yields a + 1 tokens)."""
    path: torch.Tensor
    """(B, D+1) long: node indices of the root and the accepted nodes, padded with the last accepted node."""
    next_token: torch.Tensor
    """(B,) long: the verifier's token after the accepted path (correction on rejection, bonus otherwise)."""


# ---- distributions and sampling ----------------------------------------------------------------------------------
def probs_from_logits(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """softmax(logits / T) in float32, restricted to the top-p nucleus and renormalised. (..., V) -> (..., V)

    The nucleus is the smallest set of most-likely tokens whose mass reaches top_p (the top token always stays),
    the same rule as Hugging Face's top-p warper. No top-k, no other defaults.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: probs_from_logits needs T > 0 (T = 0 is greedy)")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
        keep_sorted = before < top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / noise) with noise ~ Exponential(1): a sample from probs. (..., V) -> (...)"""
    return (probs / noise).argmax(-1)


def exponential_noise(shape, generator: torch.Generator | None, device) -> torch.Tensor:
    # Clamped so a (measure-zero) exact 0 never divides; float32 whatever the model dtype.
    return torch.empty(shape, device=device).exponential_(generator=generator).clamp_min_(1e-20)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One sample per row of probs (..., V), without a host sync."""
    return sample_from(probs, exponential_noise(probs.shape, generator, probs.device))


def _residual(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, q - p)) along V; q itself where nothing is left (q <= p everywhere, probability 0)."""
    r = (q - p).clamp_min(0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp_min(1e-30), q)


# ---- greedy ------------------------------------------------------------------------------------------------------
def greedy_chain(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Acceptance:
    """draft_tokens (B, N), target_logits (B, N+1, V) -> accept while d_i == argmax after d_{i-1}."""
    B, N = draft_tokens.shape
    target = target_logits.argmax(-1)  # (B, N+1)
    match = draft_tokens == target[:, :N]  # (B, N)
    a = match.long().cumprod(-1).sum(-1)  # (B,)
    path = torch.arange(N + 1, device=draft_tokens.device).expand(B, N + 1)
    path = torch.minimum(path, a[:, None])
    return Acceptance(a, path, target.gather(1, a[:, None])[:, 0])


def greedy_tree(draft_tokens: torch.Tensor, tree: Tree, target_logits: torch.Tensor) -> Acceptance:
    """draft_tokens (B, N), tree over N+1 nodes, target_logits (B, N+1, V) -> the deepest matching path."""
    B, N = draft_tokens.shape
    if tree.is_chain:
        return greedy_chain(draft_tokens, target_logits)
    tree = tree.expand(B)
    dev = draft_tokens.device
    target = target_logits.argmax(-1)  # (B, N+1)
    tokens = torch.cat([target.new_zeros(B, 1), draft_tokens], 1)  # (B, N+1), root slot unused
    match = tokens == target.gather(1, tree.parents.clamp_min(0))  # node's token == argmax at its parent
    match[:, 0] = True
    ok = ~((~match)[:, None, :] & tree.ancestors).any(-1)  # (B, N+1): every node on the path matches
    idx = torch.arange(N + 1, device=dev)
    score = torch.where(ok, tree.depth * (N + 2) + (N + 1 - idx), torch.full_like(tree.depth, -1))
    best = score.argmax(-1)  # (B,) deepest, then lowest index
    a = tree.depth.gather(1, best[:, None])[:, 0]
    path = _path_to(tree, best, a)
    return Acceptance(a, path, target.gather(1, best[:, None])[:, 0])


def _path_to(tree: Tree, node: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """(B, D+1) node indices from the root down to `node` (B,), padded with `node` after depth a."""
    B, N1 = tree.parents.shape
    D = tree.max_depth
    on_path = tree.ancestors.gather(1, node[:, None, None].expand(B, 1, N1))[:, 0]  # (B, N+1)
    slot = torch.where(on_path, tree.depth, torch.full_like(tree.depth, D + 1))
    idx = torch.arange(N1, device=node.device).expand(B, N1)
    path = torch.zeros(B, D + 2, dtype=torch.long, device=node.device).scatter(1, slot, idx)[:, : D + 1]
    steps = torch.arange(D + 1, device=node.device)
    return torch.where(steps[None, :] <= a[:, None], path, node[:, None])


# ---- sampling ----------------------------------------------------------------------------------------------------
def sample_chain(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                 uniform: torch.Tensor, noise: torch.Tensor) -> Acceptance:
    """Speculative sampling over a chain.

    draft_tokens (B, N); draft_probs (B, N, V) or None (one-hot); target_probs (B, N+1, V);
    uniform (B, N); noise (B, V).
    """
    B, N = draft_tokens.shape
    dev = draft_tokens.device
    q_tok = target_probs[:, :N].gather(-1, draft_tokens[..., None])[..., 0]  # (B, N) q(d_i)
    p_tok = draft_probs.gather(-1, draft_tokens[..., None])[..., 0] if draft_probs is not None \
        else torch.ones_like(q_tok)  # (B, N) p(d_i)
    accept = uniform * p_tok < q_tok  # u < q/p, i.e. with probability min(1, q/p); never when q = 0
    a = accept.long().cumprod(-1).sum(-1)  # (B,) accepted prefix length
    rows = torch.arange(B, device=dev)
    q = target_probs[rows, a]  # (B, V) verifier distribution after the accepted prefix
    # The draft distribution at the rejected position; zero when all were accepted (bonus: sample q itself).
    rejected = a < N
    a_clamped = a.clamp_max(N - 1) if N > 0 else a
    if N == 0:
        p = torch.zeros_like(q)
    elif draft_probs is not None:
        p = draft_probs[rows, a_clamped] * rejected[:, None]
    else:
        p = torch.zeros_like(q).scatter_(1, draft_tokens[rows, a_clamped][:, None], rejected[:, None].to(q.dtype))
    next_token = sample_from(_residual(q, p), noise)
    path = torch.minimum(torch.arange(N + 1, device=dev).expand(B, N + 1), a[:, None])
    return Acceptance(a, path, next_token)


def sample_tree(draft_tokens: torch.Tensor, tree: Tree, draft_probs: torch.Tensor | None,
                target_probs: torch.Tensor, uniform: torch.Tensor, noise: torch.Tensor) -> Acceptance:
    """Multi-candidate recursive rejection sampling over a tree (SpecInfer / SpecTr style), batched.

    Shapes as in `sample_chain`, plus the tree over N+1 nodes. The loop runs over depth and child rank
    (D x K small steps of (B, V) tensor ops), never over the batch, and never syncs with the host.
    """
    B, N = draft_tokens.shape
    if tree.is_chain:
        return sample_chain(draft_tokens, draft_probs, target_probs, uniform, noise)
    tree = tree.expand(B)
    dev = draft_tokens.device
    rows = torch.arange(B, device=dev)
    tokens = torch.cat([draft_tokens.new_zeros(B, 1), draft_tokens], 1)  # (B, N+1) by node
    u = torch.cat([uniform.new_zeros(B, 1), uniform], 1)  # (B, N+1) by node
    cur = torch.zeros(B, dtype=torch.long, device=dev)  # current node
    alive = torch.ones(B, dtype=torch.bool, device=dev)  # still descending
    q = target_probs[:, 0].clone()  # (B, V) the distribution the next child is tested against
    a = torch.zeros(B, dtype=torch.long, device=dev)
    D, K = tree.max_depth, tree.children.shape[-1]
    path = torch.zeros(B, D + 1, dtype=torch.long, device=dev)
    for d in range(1, D + 1):
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        kids = tree.children[rows, cur]  # (B, K) children of the current node
        for c in range(K):
            child = kids[:, c]
            trying = alive & ~moved & (child >= 0)
            node = child.clamp_min(1)
            x = tokens[rows, node]  # (B,)
            qx = q.gather(1, x[:, None])[:, 0]
            if draft_probs is not None:
                p = draft_probs[rows, node - 1]  # (B, V)
                px = p.gather(1, x[:, None])[:, 0]
            else:
                p = torch.zeros_like(q).scatter_(1, x[:, None], 1.0)
                px = torch.ones_like(qx)
            accepted = trying & (u[rows, node] * px < qx)
            rejected = trying & ~accepted
            q = torch.where(rejected[:, None], _residual(q, p), q)
            q = torch.where(accepted[:, None], target_probs[rows, node], q)
            cur = torch.where(accepted, node, cur)
            moved |= accepted
        alive &= moved
        a += moved.long()
        path[:, d] = torch.where(moved, cur, path[:, d - 1])
    return Acceptance(a, path, sample_from(q, noise))


# ---- typical acceptance (lossy) -----------------------------------------------------------------------------------
def typical_threshold(probs: torch.Tensor, epsilon: float, alpha: float) -> torch.Tensor:
    """Medusa's per-position threshold min(epsilon, alpha * exp(-H(probs))), H with Medusa's +1e-5 inside the log.
    (..., V) -> (...)"""
    entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)
    return torch.minimum(torch.full_like(entropy, epsilon), alpha * torch.exp(-entropy))


def typical_tree(draft_tokens: torch.Tensor, tree: Tree, target_probs: torch.Tensor, noise: torch.Tensor,
                 epsilon: float = 0.09, alpha: float = 0.3) -> Acceptance:
    """Medusa's typical acceptance over a tree: LOSSY (see the module docstring).

    draft_tokens (B, N); target_probs (B, N+1, V) by node (temperature / top-p already applied); noise (B, V).
    """
    B, N = draft_tokens.shape
    tree = tree.expand(B)
    dev = draft_tokens.device
    threshold = typical_threshold(target_probs, epsilon, alpha)  # (B, N+1) at each node, for its children
    tokens = torch.cat([draft_tokens.new_zeros(B, 1), draft_tokens], 1)  # (B, N+1), root slot unused
    parent = tree.parents.clamp_min(0)  # (B, N+1)
    V = target_probs.shape[-1]
    q_tok = target_probs.flatten(1).gather(1, parent * V + tokens)  # (B, N+1): q(token) at the node's parent
    kept = q_tok > threshold.gather(1, parent)
    kept[:, 0] = True
    ok = ~((~kept)[:, None, :] & tree.ancestors).any(-1)  # (B, N+1): the whole path is kept
    logq = torch.where(ok, q_tok.clamp_min(1e-30).log(), torch.zeros_like(q_tok))
    logq[:, 0] = 0
    likelihood = (tree.ancestors.float() @ logq[..., None])[..., 0]  # (B, N+1): log q of the path's tokens
    depth = torch.where(ok, tree.depth, torch.full_like(tree.depth, -1))
    deepest = depth.amax(-1, keepdim=True)
    score = torch.where(depth == deepest, likelihood, torch.full_like(likelihood, -float("inf")))
    best = score.argmax(-1)  # (B,) deepest kept node, then the most likely path (then the lowest index)
    a = tree.depth.gather(1, best[:, None])[:, 0]
    rows = torch.arange(B, device=dev)
    q = target_probs[rows, best]  # (B, V)
    typical_set = (q > typical_threshold(q, epsilon, alpha)[:, None]) | (q == q.amax(-1, keepdim=True))
    return Acceptance(a, _path_to(tree, best, a), sample_from(q * typical_set, noise))


# ---- dispatch ----------------------------------------------------------------------------------------------------
def accept(draft_tokens: torch.Tensor, tree: Tree, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
           temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None,
           typical: tuple[float, float] | None = None) -> Acceptance:
    """Greedy at temperature 0, lossless speculative sampling otherwise; chain or tree by `tree`.

    typical=(epsilon, alpha) switches sampling (T > 0) to Medusa's LOSSY typical acceptance."""
    if temperature <= 0:
        return greedy_tree(draft_tokens, tree, target_logits)
    B, N = draft_tokens.shape
    target_probs = probs_from_logits(target_logits, temperature, top_p)  # (B, N+1, V)
    uniform = torch.rand(B, N, generator=generator, device=draft_tokens.device)
    noise = exponential_noise((B, target_probs.shape[-1]), generator, draft_tokens.device)
    if typical is not None:
        return typical_tree(draft_tokens, tree, target_probs, noise, *typical)
    if draft_probs is not None:
        draft_probs = draft_probs.float()
    return sample_tree(draft_tokens, tree, draft_probs, target_probs, uniform, noise)
