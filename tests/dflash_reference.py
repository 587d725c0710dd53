"""Slow references for DFlash (models/dflash/): the anchored block mask and the losses (DFlash's, D-PACE's) written
as loops, a reference-style greedy decode with our drafter, and the case folders the `dflash` package's runner reads
(`lively_case`: the one both reference tests in tests/e2e/ build)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F


def slow_block_mask(anchors, valid, T: int, N: int, window: int | None = None) -> torch.Tensor:
    """The anchored block mask, one entry at a time from its definition (models/dflash/blocks.py)."""
    B, A = anchors.shape
    mask = torch.zeros(B, A * N, T + A * N, dtype=torch.bool)
    for b in range(B):
        for j in range(A):
            a = int(anchors[b, j]) if valid[b, j] else 0
            for i in range(N):
                q = j * N + i
                qpos = a + i
                for s in range(T):
                    if valid[b, j] and s < a and (window is None or qpos - s < window):
                        mask[b, q, s] = True
                for i2 in range(N):
                    if window is None or (i2 <= i and i - i2 < window):
                        mask[b, q, T + j * N + i2] = True
    return mask


def slow_loss(logits, input_ids, loss_mask, anchors, valid, gamma: float, teacher=None) -> torch.Tensor:
    """The DFlash loss by loops: logits (B, A, N-1, V) of block positions 1..N-1; targets x_{a+k}, or with teacher
    (B, T, V) (the verifier's logits) KL(softmax(teacher[a+k-1]) || softmax(logits))."""
    B, A, K, _ = logits.shape
    T = input_ids.shape[1]
    num, den = 0.0, 0.0
    for b in range(B):
        for j in range(A):
            if not valid[b, j]:
                continue
            a = int(anchors[b, j])
            for k in range(1, K + 1):
                if a + k >= T or not loss_mask[b, a + k]:
                    continue
                w = math.exp(-(k - 1) / gamma)
                log_q = F.log_softmax(logits[b, j, k - 1].double(), -1)
                if teacher is None:
                    loss = -log_q[input_ids[b, a + k]]
                else:
                    log_p = F.log_softmax(teacher[b, a + k - 1].double(), -1)
                    loss = (log_p.exp() * (log_p - log_q)).sum()
                num += w * float(loss)
                den += w
    return torch.tensor(num / den, dtype=torch.float64)


def slow_dpace_loss(logits, targets, trained, alpha: float, chained=None) -> torch.Tensor:
    """D-PACE by loops, from its definition (arXiv 2605.18810, eqs. 7-9): logits (B, A, K, V) of block positions
    1..K, targets / trained / chained (B, A, K). Per block: q_k = softmax(logits_k)[target_k] (0 where chained but
    not trained), smoothed (1 - alpha) q_k + alpha on the chain and 1 off it, P_m the product of the smoothed q over
    positions 1..m, w_k = the sum of P_m over trained m >= k; the loss is the sum over blocks of
    sum_k w_k * CE_k over trained k, w held constant, divided by the number of blocks with a trained position.
    Differentiable in logits (autograd through each CE term)."""
    B, A, K, _ = logits.shape
    chained = trained if chained is None else chained
    total, blocks = logits.new_zeros(()), 0
    for b in range(B):
        for j in range(A):
            if not any(bool(trained[b, j, k]) for k in range(K)):
                continue
            blocks += 1
            ce, smooth = {}, []
            for k in range(K):
                if trained[b, j, k]:
                    ce[k] = -F.log_softmax(logits[b, j, k], -1)[targets[b, j, k]]
                q = math.exp(-float(ce[k].detach())) if k in ce else 0.0
                smooth.append((1 - alpha) * q + alpha if chained[b, j, k] else 1.0)
            for k in ce:
                weight = 0.0
                for m in range(k, K):
                    if m in ce:
                        reach = 1.0
                        for i in range(m + 1):
                            reach *= smooth[i]
                        weight += reach
                total = total + weight * ce[k]
    return total / max(blocks, 1)


@torch.no_grad()
def greedy_decode(drafter, target, input_ids: torch.Tensor, max_new_tokens: int, stop: list[int] | None = None
                  ) -> tuple[torch.Tensor, list[int]]:
    """Greedy speculative decoding of one prompt (1, P) with our drafter and an HF target, step by step as the
    reference's loop: the drafter's context cache grows by what was accepted (context_kv), the block attends to it.
    Returns (output ids (1, <= P + max_new_tokens), tokens produced per step)."""
    from transformers import DynamicCache

    from draftheads.models.dflash import DFlashCache

    N = drafter.block_size
    P = input_ids.shape[1]
    max_length = P + max_new_tokens
    out = torch.full((1, max_length + 1), drafter.mask_token_id, dtype=torch.long)
    out[:, :P] = input_ids
    positions = torch.arange(max_length + 1)[None]
    layers = drafter.feature_layers  # HF hidden_states indices: the target layers' outputs

    def context(hs, count):
        return torch.cat([hs[i][:, :count] for i in layers], dim=-1)

    cache_t = DynamicCache(config=target.config)
    o = target(input_ids, position_ids=positions[:, :P], cache=cache_t, use_cache=True,
               output_hidden_states=True)
    out[:, P] = o.logits[:, -1].argmax(-1)
    ctx_hidden, ctx_start = context(o.hidden_states, P), 0
    cache_d = DFlashCache(len(drafter.layers))
    stop_t = torch.tensor(stop or [], dtype=torch.long)
    start, produced_per_step = P, []
    stopped = bool(torch.isin(out[:, start], stop_t).any())
    while start + 1 < max_length and not stopped:
        size = min(N, max_length - start)
        block = out[:, start:start + size].clone()
        if size > 1:
            for i, (k, v) in enumerate(drafter.context_kv(ctx_hidden, positions[:, ctx_start:start])):
                cache_d.update(k, v, i)  # append what was accepted: the context grows, nothing to roll back

            def attend(i, q, k, v):
                kc, vc = cache_d.keys[i], cache_d.values[i]
                return drafter.layers[i].self_attn.attend(q, torch.cat([kc, k], 2), torch.cat([vc, v], 2), None)

            hidden = drafter.block(drafter.embed(block), positions[:, start:start + size], attend)
            block[:, 1:] = drafter.logits(hidden[:, 1:]).argmax(-1)
        o = target(block, position_ids=positions[:, start:start + size], cache=cache_t, use_cache=True,
                   output_hidden_states=True)
        posterior = o.logits.argmax(-1)
        accepted = int((block[:, 1:] == posterior[:, :-1]).cumprod(1).sum())
        out[:, start:start + accepted + 1] = block[:, :accepted + 1]
        out[:, start + accepted + 1] = posterior[:, accepted]
        produced = min(accepted + 1, max_length - start - 1)
        hits = torch.isin(out[0, start + 1:start + produced + 1], stop_t).nonzero()
        if hits.numel():
            produced, stopped = int(hits[0, 0]) + 1, True
        ctx_hidden, ctx_start = context(o.hidden_states, produced), start
        start += produced
        cache_t.crop(start - cache_t.get_seq_length())
        produced_per_step.append(produced)
    return out[:, :min(start + 1, max_length)], produced_per_step


def write_case(folder: Path, drafter, forward_inputs: dict, target=None, generate: dict | None = None) -> Path:
    """A case folder for tests/dflash_reference_runner.py: our drafter as the reference's model folder (its Qwen3
    config with `dflash_config`, our state dict unchanged), the forward inputs, and optionally an HF target."""
    from safetensors.torch import save_file

    cfg = drafter.cfg
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "drafter").mkdir(exist_ok=True)
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings, "attention_bias": cfg.attention_bias,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, "vocab_size": cfg.vocab_size,
        "num_target_layers": cfg.num_target_layers, "tie_word_embeddings": False, "torch_dtype": "float32",
        "dflash_config": {"target_layer_ids": cfg.target_layer_ids, "block_size": cfg.block_size,
                          "mask_token_id": cfg.mask_token_id},
    }
    (folder / "drafter" / "config.json").write_text(json.dumps(config, indent=1))
    state = {k: v.detach().float().contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(folder / "drafter" / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in forward_inputs.items()}, str(folder / "forward.safetensors"))
    if target is not None:
        target.save_pretrained(folder / "target", safe_serialization=True)
        (folder / "generate.json").write_text(json.dumps(generate))
    return folder


PROMPT = [1, 0, 2, 2, 1, 0]
NEW_TOKENS = 40


def lively_case(folder: Path, rows: int, first_position: int):
    """(target, verifier, drafter, forward inputs, case folder) for the reference tests: a 4-token vocabulary and a
    lively random target (init 0.5, seed 1) with a random 2-layer drafter (block 4), so random drafts are accepted
    often enough that the accepted counts vary from step to step (1 to the whole block) and comparing them can
    fail. The forward inputs are `rows` rows of 5 context positions and a block, positions from `first_position`;
    the case folder (`write_case`) asks the reference to decode PROMPT for NEW_TOKENS tokens."""
    from draftheads.models.dflash import DFlashConfig, build_drafter
    from draftheads.models.verifier import Verifier
    from tests.utils import tiny_model

    target = tiny_model("qwen3", seed=1, num_layers=6, vocab_size=4, initializer_range=0.5)
    verifier = Verifier(target)
    torch.manual_seed(0)
    drafter = build_drafter(verifier, DFlashConfig(num_hidden_layers=2, block_size=4, mask_token_id=3)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(0)
    n, N, H = 5, drafter.block_size, drafter.cfg.hidden_size
    inputs = {"target_hidden": torch.randn(rows, n, 2 * H, generator=g),
              "noise_embedding": torch.randn(rows, N, H, generator=g),
              "position_ids": torch.arange(first_position, first_position + n + N)[None].expand(rows, -1)}
    case = write_case(folder, drafter, inputs, target, {"input_ids": PROMPT, "max_new_tokens": NEW_TOKENS,
                                                         "stop": None})
    return target, verifier, drafter, inputs, case
