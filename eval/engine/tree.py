"""Draft trees as tensors: a parent-index array per row, and what verification needs from it.

A tree has N+1 nodes. Node 0 is the root: the pending token, already chosen by the verifier but not yet in its
KV cache. Nodes 1..N are draft tokens, in an order where every parent comes before its children
(`parents[i] < i`). A chain of N draft tokens is the tree with `parents[i] = i - 1`.

Layout (batch-first, so rows can carry different trees, as EAGLE-2's dynamic trees do):
  parents   (B, N+1) long   parents[:, 0] = -1
  depth     (B, N+1) long   depth[:, 0] = 0; a node's position is prefix length + depth
  ancestors (B, N+1, N+1)   ancestors[b, i, j]: node j is node i or one of its ancestors (the attention mask)
  children  (B, N+1, K)     children of each node in index order, padded with -1

The verifier attends, for tree node i, to the whole committed prefix plus the slots of i's ancestors-or-self;
`tree_attention_mask` builds that boolean mask over a window of the static KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    """A draft tree over N+1 nodes (node 0 = the pending root). Build with `chain`, `from_branching`,
    `from_paths` or `from_parents`."""

    parents: torch.Tensor
    """(B, N+1) long: parent node of each node; -1 for the root."""
    depth: torch.Tensor
    """(B, N+1) long: distance from the root."""
    ancestors: torch.Tensor
    """(B, N+1, N+1) bool: ancestors[b, i, j] is True when j is i or an ancestor of i."""
    children: torch.Tensor
    """(B, N+1, K) long: each node's children in index order, -1 padded (K = most children of any node)."""
    max_depth: int
    """D: the deepest node's depth (a Python int, so buffers can be sized without a host sync)."""
    is_chain: bool
    """True when every node's parent is the node before it: acceptance and compaction take the fast path."""

    @property
    def num_nodes(self) -> int:
        """N+1, the root included."""
        return self.parents.shape[1]

    @property
    def batch_size(self) -> int:
        return self.parents.shape[0]

    # ---- builders ------------------------------------------------------------------------------------------------
    @classmethod
    def chain(cls, num_draft: int, batch_size: int = 1, device=None) -> "Tree":
        """The chain root -> d1 -> ... -> d_N."""
        parents = torch.arange(-1, num_draft, device=device)
        return cls.from_parents(parents.expand(batch_size, -1), max_depth=num_draft, max_children=1)

    @classmethod
    def from_branching(cls, branching: list[int] | tuple[int, ...], batch_size: int = 1, device=None) -> "Tree":
        """Every node at depth d-1 gets branching[d-1] children; nodes are numbered breadth first, so the children
        of one node are consecutive and a depth's nodes form one range. (2, 2, 1) -> 2 + 4 + 4 = 10 draft nodes."""
        if not branching or any(int(k) < 1 for k in branching):
            raise ValueError(f"tree branching {list(branching)!r}: expected a non-empty list of positive ints")
        parents, level = [-1], [0]
        for k in branching:
            nxt = []
            for p in level:
                for _ in range(int(k)):
                    parents.append(p)
                    nxt.append(len(parents) - 1)
            level = nxt
        return cls.from_parents(torch.tensor(parents, device=device).expand(batch_size, -1))

    @classmethod
    def from_paths(cls, paths: list[list[int]] | list[tuple[int, ...]], batch_size: int = 1, device=None) -> "Tree":
        """Medusa-style choices: each path is a list of ranks, e.g. (0, 1) = the second-best token of depth 2 after
        the best token of depth 1. Every prefix of a path must be present or is added. Nodes are sorted by
        (depth, path), so siblings appear in rank order."""
        nodes = set()
        for path in paths:
            path = tuple(int(r) for r in path)
            if not path or any(r < 0 for r in path):
                raise ValueError(f"tree path {list(path)!r}: expected a non-empty list of ranks >= 0")
            nodes.update(path[:i] for i in range(1, len(path) + 1))
        order = sorted(nodes, key=lambda p: (len(p), p))
        index = {(): 0, **{p: i + 1 for i, p in enumerate(order)}}
        parents = [-1] + [index[p[:-1]] for p in order]
        return cls.from_parents(torch.tensor(parents, device=device).expand(batch_size, -1))

    @classmethod
    def from_parents(cls, parents: torch.Tensor, max_depth: int | None = None,
                     max_children: int | None = None) -> "Tree":
        """Build from a parent array (N+1,) or (B, N+1) with parents[..., 0] = -1 and parents[..., i] < i.

        `max_depth` / `max_children` may be given to avoid a host sync (dynamic trees built on the device);
        otherwise they are read from the tensor and the parent order is checked.
        """
        if parents.dim() == 1:
            parents = parents[None]
        parents = parents.long()
        B, N1 = parents.shape
        idx = torch.arange(N1, device=parents.device)
        check = max_depth is None or max_children is None
        if check:
            if not bool((parents[:, 0] == -1).all()) or not bool((parents[:, 1:] < idx[1:]).all()) or \
                    not bool((parents[:, 1:] >= 0).all()):
                raise ValueError("tree parents must have parents[0] = -1 and 0 <= parents[i] < i for i >= 1")
        # Ancestor-or-self matrix, one level per pass: row i = self | row of parent(i). After D passes every node
        # has its whole chain. Gathers only (no boolean indexing), so a dynamic tree is built without a host sync.
        eye = torch.eye(N1, dtype=torch.bool, device=parents.device).expand(B, N1, N1)
        up = parents.clamp_min(0)[:, :, None].expand(B, N1, N1)  # row index of each node's parent
        has_parent = (parents >= 0)[:, :, None]
        ancestors = eye.clone()
        for _ in range(max_depth if max_depth is not None else N1 - 1):
            ancestors = eye | (has_parent & ancestors.gather(1, up))
        depth = ancestors.sum(-1) - 1  # (B, N+1): ancestors besides itself
        if max_depth is None:
            max_depth = int(depth.max())
        # Children in index order: sort each node's child indices, non-children pushed to the end.
        is_child = parents[:, None, :] == idx[None, :, None]  # (B, parent, child)
        if max_children is None:
            max_children = max(int(is_child.sum(-1).max()), 1)
        key = torch.where(is_child, idx[None, None, :], N1 + idx[None, None, :])
        order = key.sort(-1).values[..., :max_children]  # (B, N+1, K)
        children = torch.where(order < N1, order, torch.full_like(order, -1))
        # At most one child per node, all nodes hanging from the root, parents[i] < i: the chain 0 -> 1 -> ... -> N.
        is_chain = max_children == 1
        return cls(parents=parents, depth=depth, ancestors=ancestors, children=children, max_depth=max_depth,
                   is_chain=is_chain)

    def expand(self, batch_size: int) -> "Tree":
        """The same tree for `batch_size` rows (a view when this tree has one row)."""
        if self.batch_size == batch_size:
            return self
        if self.batch_size != 1:
            raise ValueError(f"cannot expand a tree of {self.batch_size} rows to {batch_size}")
        return Tree(self.parents.expand(batch_size, -1), self.depth.expand(batch_size, -1),
                    self.ancestors.expand(batch_size, -1, -1), self.children.expand(batch_size, -1, -1),
                    self.max_depth, self.is_chain)

    def to(self, device) -> "Tree":
        return Tree(self.parents.to(device), self.depth.to(device), self.ancestors.to(device),
                    self.children.to(device), self.max_depth, self.is_chain)


def tree_attention_mask(base: torch.Tensor, ancestors: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean attention mask over a KV-cache window for queries laid out as a tree after a committed prefix.

    base:      (B,) committed slots per row; the tree's nodes sit in slots base .. base+S-1
    ancestors: (B, n, S) bool, the query nodes' ancestor-or-self rows over the S tree slots
    returns    (B, n, W) bool: query may read slot j if j < base (the prefix) or slot j holds one of its ancestors
    """
    B, n, S = ancestors.shape
    j = torch.arange(window, device=base.device)
    prefix = j[None, :] < base[:, None]  # (B, W)
    rel = j[None, :] - base[:, None]  # (B, W) slot relative to the tree's first slot
    inside = (rel >= 0) & (rel < S)
    tree = ancestors.gather(2, rel.clamp(0, S - 1)[:, None, :].expand(B, n, window))  # (B, n, W)
    return prefix[:, None, :] | (inside[:, None, :] & tree)
