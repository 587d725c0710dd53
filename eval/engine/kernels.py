"""Fused Triton kernels for the decode step: acceptance (greedy and stochastic, chain or tree) and KV compaction.

Each function here is a drop-in for a torch reference with the same inputs, the same randomness tensors and the
same outputs; the reference is what runs without Triton or on the CPU:

    greedy_accept(draft_tokens, tree, target_logits)                       == acceptance.greedy_tree
    sample_accept(draft_tokens, tree, draft_probs, target_probs, u, noise) == acceptance.sample_tree
    accept(draft_tokens, tree, draft_probs, target_logits, T, top_p, gen)  == acceptance.accept (same draws)
    compact(cache, base, path)                                             == StaticKVCache.compact
    FusedKVCache: a StaticKVCache whose `compact` is the kernel

Why fused. In eager torch, tree acceptance is D x K small steps of (B, V) ops (tens to hundreds of launches) and
compaction is an index_put per layer and per K/V buffer; on a GPU, launches and Python, not bytes, are the cost.
Here acceptance is two launches (greedy: an argmax over the vocabulary for every node, then a tree walk per row)
or one (sampling: the whole recursive rejection walk per row, with a (B, V) scratch row for residuals), and
compaction is one launch for every layer (a table of buffer pointers). Nothing syncs with the host; outputs stay
on the device for the decode loop's one sync per step.

Kernels (eval/engine/_triton_kernels.py):
  argmax_rows_kernel   grid (B*(N+1),)        verifier argmax after every node, ties to the lowest index
  greedy_walk_kernel   grid (B,)              deepest fully-matching path, its length, the next token
  sample_walk_kernel   grid (B,)              accept / residual / bonus over the tree, the sampled next token
  compact_kernel       grid (2L, B, H_kv)     accepted K/V to consecutive slots, all layers, bit-exact

Exactness: greedy outputs are identical to the reference (no float arithmetic besides comparisons). Sampling
repeats the reference's float operations in order (IEEE division, no fused multiply-add); only the float32 sum
that normalises a residual can differ from torch's in its last bit, so a discrete outcome can differ only when a
uniform or a probability ratio sits within one rounding step of its threshold (the tests check equality on random
inputs). Compaction copies bits.

Backends (`backend=`): "auto" runs the compiled kernels on CUDA tensors when Triton is installed, and the torch
reference otherwise; "triton" always runs the kernels; "torch" always runs the reference. With TRITON_INTERPRET=1
set before triton is imported, Triton's interpreter runs the kernels with numpy on any device: that is how the CPU
tests check them (tests/e2e/test_kernels.py starts a child pytest with the variable set, so the interpreter never
reaches the compiled kernels of another process). Triton is optional: importing this module never needs it, and
`backend="triton"` without it raises `KernelUnavailable`.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from draftheads.eval.engine.acceptance import Acceptance, exponential_noise, greedy_tree, probs_from_logits, sample_tree
from draftheads.eval.engine.runtime import StaticKVCache
from draftheads.eval.engine.tree import Tree

BACKENDS = ("auto", "triton", "torch")

#: Vocabulary block per loop iteration. GPUs: 1024 lanes (4 warps x 8 fp32 each). The interpreter runs each
#: iteration as numpy ops, so it takes whole (small) vocabularies in one block.
BLOCK_V = 1024
INTERPRET_BLOCK_V = 4096


class KernelUnavailable(RuntimeError):
    """The Triton backend was asked for where it cannot run; the message says what to install or change."""


def triton_available() -> bool:
    """True when the `triton` package can be imported (the kernels can run, compiled or interpreted)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_active() -> bool:
    """True when TRITON_INTERPRET=1 is set: Triton then runs every kernel with numpy, CPU tensors included.

    Triton decides this once, when it is imported (its own library functions are built for one mode), so the
    variable must be set before anything imports triton; a process cannot mix compiled and interpreted kernels.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def kernel_mode(device: torch.device, backend: str) -> str:
    """'torch', 'compiled' or 'interpret' for tensors on `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return "torch"
    if backend == "auto" and (not triton_available() or (device.type != "cuda" and not interpreter_active())):
        return "torch"
    if not triton_available():
        raise KernelUnavailable("backend='triton' needs the triton package: pip install 'draftheads[cuda]' "
                                "(or pip install triton); backend='torch' runs the reference instead")
    if interpreter_active():
        return "interpret"
    if device.type != "cuda":
        raise KernelUnavailable(f"backend='triton' on {device.type} tensors needs Triton's interpreter: set "
                                "TRITON_INTERPRET=1 before triton is first imported (or use backend='auto' / "
                                "'torch', which run the torch reference there)")
    return "compiled"


def _launch(mode: str):
    """Kernel module, launch options and vocabulary block for a mode."""
    import draftheads.eval.engine._triton_kernels as module  # needs triton; interpreted when TRITON_INTERPRET=1

    if mode == "compiled":
        return module, dict(enable_fp_fusion=False), BLOCK_V
    return module, {}, INTERPRET_BLOCK_V


def _pow2(n: int, least: int = 2) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def _block(V: int, limit: int) -> int:
    return min(_pow2(V, 16), limit)


def _walk_setup(draft_tokens: torch.Tensor, tree: Tree, target: torch.Tensor, mode: str):
    """(B, N, N1, V, the tree expanded to B rows, kernel module, launch options, block limit) for an acceptance walk
    over draft_tokens (B, N) and the verifier's `target` (B, N+1, V); shapes checked."""
    B, N = draft_tokens.shape
    N1, V = target.shape[1], target.shape[2]
    _check_shapes(draft_tokens, tree, N1)
    k, opts, limit = _launch(mode)
    return B, N, N1, V, tree.expand(B), k, opts, limit


# ---- acceptance --------------------------------------------------------------------------------------------------
def greedy_accept(draft_tokens: torch.Tensor, tree: Tree, target_logits: torch.Tensor,
                  backend: str = "auto") -> Acceptance:
    """draft_tokens (B, N), tree over N+1 nodes, target_logits (B, N+1, V) -> the deepest path whose every token
    is the verifier's argmax at its parent (ties: lowest node index); `draftheads.eval.engine.acceptance.greedy_tree`."""
    mode = kernel_mode(draft_tokens.device, backend)
    if mode == "torch":
        return greedy_tree(draft_tokens, tree, target_logits)
    B, N, N1, V, tree, k, opts, limit = _walk_setup(draft_tokens, tree, target_logits, mode)
    dev, D = draft_tokens.device, tree.max_depth
    logits = target_logits.reshape(B * N1, V)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    top = torch.empty(B, N1, dtype=torch.long, device=dev)  # (B, N+1) argmax after each node
    k.argmax_rows_kernel[(B * N1,)](logits, top, V, logits.stride(0), BLOCK_V=_block(V, limit), **opts)
    a = torch.empty(B, dtype=torch.long, device=dev)
    path = torch.empty(B, D + 1, dtype=torch.long, device=dev)
    nxt = torch.empty(B, dtype=torch.long, device=dev)
    parents, depth, anc = _tree_rows(tree)
    k.greedy_walk_kernel[(B,)](top, draft_tokens.contiguous(), parents, depth, anc, a, path, nxt,
                               N, D, parents.stride(0), depth.stride(0), anc.stride(0), anc.stride(1),
                               NP=_pow2(N1), DP=_pow2(D + 1), **opts)
    return Acceptance(a, path, nxt)


def sample_accept(draft_tokens: torch.Tensor, tree: Tree, draft_probs: torch.Tensor | None,
                  target_probs: torch.Tensor, uniform: torch.Tensor, noise: torch.Tensor,
                  backend: str = "auto") -> Acceptance:
    """Lossless speculative sampling over a chain or tree with explicit randomness; `draftheads.eval.engine.acceptance.sample_tree`
    (which is `sample_chain` for chains). Shapes: draft_tokens (B, N), draft_probs (B, N, V) or None (one-hot),
    target_probs (B, N+1, V) float32, uniform (B, N), noise (B, V)."""
    mode = kernel_mode(draft_tokens.device, backend)
    if mode == "torch":
        return sample_tree(draft_tokens, tree, draft_probs, target_probs, uniform, noise)
    B, N, N1, V, tree, k, opts, limit = _walk_setup(draft_tokens, tree, target_probs, mode)
    dev, D = draft_tokens.device, tree.max_depth
    tprobs = target_probs.float().contiguous()
    dprobs = draft_probs.float().contiguous() if draft_probs is not None else tprobs  # unused when None
    children = tree.children
    scratch = torch.empty(B, V, dtype=torch.float32, device=dev)  # residual distributions, per row
    a = torch.empty(B, dtype=torch.long, device=dev)
    path = torch.empty(B, D + 1, dtype=torch.long, device=dev)
    nxt = torch.empty(B, dtype=torch.long, device=dev)
    k.sample_walk_kernel[(B,)](draft_tokens.contiguous(), children, dprobs, tprobs, uniform.float().contiguous(),
                               noise.float().contiguous(), scratch, a, path, nxt,
                               N, D, children.shape[-1], V, children.stride(0), children.stride(1),
                               children.stride(2), HAS_PROBS=draft_probs is not None, IS_CHAIN=tree.is_chain,
                               BLOCK_V=_block(V, limit), **opts)
    return Acceptance(a, path, nxt)


def accept(draft_tokens: torch.Tensor, tree: Tree, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
           temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None,
           backend: str = "auto") -> Acceptance:
    """`draftheads.eval.engine.acceptance.accept` through the kernels: greedy at temperature 0, lossless sampling otherwise, with the
    same random draws in the same order from `generator` (so the same seed gives the same tokens)."""
    if temperature <= 0:
        return greedy_accept(draft_tokens, tree, target_logits, backend)
    B, N = draft_tokens.shape
    # The same draws, in the same order, as draftheads.eval.engine.acceptance.accept (tests/e2e/test_kernels.py checks they agree).
    target_probs = probs_from_logits(target_logits, temperature, top_p)  # (B, N+1, V)
    uniform = torch.rand(B, N, generator=generator, device=draft_tokens.device)
    noise = exponential_noise((B, target_probs.shape[-1]), generator, draft_tokens.device)
    if draft_probs is not None:
        draft_probs = draft_probs.float()
    return sample_accept(draft_tokens, tree, draft_probs, target_probs, uniform, noise, backend)


def _check_shapes(draft_tokens: torch.Tensor, tree: Tree, N1: int) -> None:
    if draft_tokens.shape[1] + 1 != N1 or tree.num_nodes != N1:
        raise ValueError(f"acceptance kernel: draft_tokens {tuple(draft_tokens.shape)}, a tree of {tree.num_nodes} "
                         f"nodes and verifier outputs for {N1} nodes do not agree (expected N draft tokens, N+1 "
                         "nodes, N+1 rows of logits)")


def _tree_rows(tree: Tree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents, depth (B, N+1) long and ancestors (B, N+1, N+1) uint8 with unit inner strides (batch stride may
    be 0: an expanded tree is not copied)."""
    parents, depth, anc = tree.parents, tree.depth, tree.ancestors.view(torch.uint8)
    if parents.stride(-1) != 1:
        parents = parents.contiguous()
    if depth.stride(-1) != 1:
        depth = depth.contiguous()
    if anc.stride(-1) != 1 or anc.stride(-2) != anc.shape[-1]:
        anc = anc.contiguous()
    return parents, depth, anc


# ---- KV compaction -----------------------------------------------------------------------------------------------
def compact(cache: StaticKVCache, base: torch.Tensor, path: torch.Tensor, backend: str = "auto") -> None:
    """Move the accepted path to consecutive slots in every layer: slot base+path[:, j] -> slot base+j.
    base (B,), path (B, P). `StaticKVCache.compact` in one launch (bit-exact, the garbage past the accepted length
    included)."""
    mode = kernel_mode(base.device, backend)
    if mode == "interpret" and base.device.type != "cpu":
        mode = "torch"  # the interpreter cannot follow a table of device pointers
    if mode == "torch":
        StaticKVCache.compact(cache, base, path)
        return
    k, opts, _ = _launch(mode)
    table = _pointer_table(cache)
    buf = cache.keys[0]
    B, H, _, hd = buf.shape
    path = path.contiguous()
    k.compact_kernel[(table.numel(), B, H)](table, cache.key_positions, base.contiguous(), path, path.shape[1],
                                            buf.stride(0), buf.stride(1), buf.stride(2),
                                            cache.key_positions.stride(0), hd, ELEM=buf.element_size(),
                                            BLOCK_D=_pow2(hd, 16), **opts)


def _pointer_table(cache: StaticKVCache) -> torch.Tensor:
    """(2L,) int64 data pointers of every key and value buffer, built once per cache (its buffers never move)."""
    table = getattr(cache, "_kernel_pointer_table", None)
    if table is None:
        bufs = [*cache.keys, *cache.values]
        first = bufs[0]
        for t in bufs:
            if t.shape != first.shape or t.dtype != first.dtype or t.stride() != first.stride() or \
                    t.stride(-1) != 1 or t.device != first.device:
                raise ValueError("compaction kernel: every K/V buffer must have one shape, dtype and layout "
                                 f"(got {tuple(t.shape)} {t.dtype} {t.stride()} vs {tuple(first.shape)} "
                                 f"{first.dtype} {first.stride()})")
        table = torch.tensor([t.data_ptr() for t in bufs], dtype=torch.int64, device=first.device)
        cache._kernel_pointer_table = table
    return table


class FusedKVCache(StaticKVCache):
    """A StaticKVCache whose `compact` is the one-launch kernel (the torch reference where Triton cannot run)."""

    def __init__(self, *args, backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.backend = backend
        _pointer_table(self)  # now, not inside a CUDA-graph capture (it copies the pointers to the device)

    @classmethod
    def for_runner(cls, runner, batch_size: int, capacity: int, backend: str = "auto") -> "FusedKVCache":
        """The cache `runner.new_cache(batch_size, capacity)` would build, with the fused compaction."""
        return cls(len(runner.layers), batch_size, capacity, runner.num_kv_heads, runner.head_dim, runner.dtype,
                   runner.device, backend=backend)

    def compact(self, base: torch.Tensor, path: torch.Tensor) -> None:
        compact(self, base, path, self.backend)
