"""`MtpDrafter`: a checkpoint's MTP layer as a module (the verifier's own decoder-layer class), its step, and the
unrolled training loss.

    weights = read_mtp_layer(verifier.path)                       # models/layouts/mtp_checkpoint.py
    drafter = build_mtp_drafter(verifier, weights, MtpConfig())
    out = drafter(next_tokens, hidden, position_ids)              # (B, T, H): the layer's output, pre-norm
    logits = drafter.logits(out)                                  # (B, T, V)
    step = drafter.train_forward(input_ids, final, loss_mask, labels, position_ids)   # MtpOutput

Module names are the checkpoint's inside the layer (enorm, hnorm, eh_proj, shared_head.norm; the decoder block's
under `block.`, experts fused as transformers holds them), so `checkpoint_tensors` gives back exactly the names read.
The embedding and the LM head are the verifier's (frozen, not registered here, so neither a run-folder checkpoint
nor the optimizer holds them), or the layer's own copies when it ships different ones (non-persistent buffers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftheads.models.eagle.metrics import StepCounts, step_counts
from draftheads.models.layouts.mtp_checkpoint import MTP_PARTS, SHARED_COPIES, MtpWeights, fuse_experts, \
    split_experts
from draftheads.models.linear_loss import linear_loss
from draftheads.models.mtp.config import MtpConfig, MtpError
from draftheads.models.placed import embedding_rows


@dataclass
class MtpOutput:
    """One training forward: the loss to backpropagate and what to log."""

    loss: torch.Tensor
    """Scalar, differentiable: Σ_k w_k · mean CE of step k."""
    step_losses: torch.Tensor
    """(K,) detached mean cross-entropy of each unrolled step."""
    counts: StepCounts
    """Per-step accuracy counts against the labels (a chain from each position)."""


def shift_left(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """x[:, p + k] at p (B, T, ...), `fill` past the end."""
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], pad], 1)


def step_weights(steps: int, decay: float) -> torch.Tensor:
    """(K,) decay^(k-1), normalised to sum 1."""
    w = decay ** torch.arange(steps, dtype=torch.float32)
    return w / w.sum()


class MtpDrafter(nn.Module):
    """The MTP layer of `weights`' checkpoint for `verifier`, loaded strictly (init: shipped) or freshly initialised
    (init: random)."""

    def __init__(self, verifier, weights: MtpWeights, cfg: MtpConfig | None = None):
        super().__init__()
        self.cfg = cfg or MtpConfig()
        config = verifier.config
        if config.model_type != weights.model_type:
            raise MtpError(f"{weights.folder}: its MTP layer is {weights.model_type}'s, the verifier "
                           f"{verifier.name!r} is {config.model_type}")
        if weights.layer_index != config.num_hidden_layers:
            raise MtpError(f"{weights.folder}: MTP layer index {weights.layer_index}, the verifier has "
                           f"{config.num_hidden_layers} layers; expected the layer right after them")
        H, eps = verifier.hidden_size, config.rms_norm_eps
        norm = type(verifier.norm)
        self.model_type, self.layer_index, self.folder = weights.model_type, weights.layer_index, weights.folder
        self.enorm, self.hnorm = norm(H, eps=eps), norm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = norm(H, eps=eps)
        # The verifier's own decoder-layer class at index L: it decides dense or MoE, attention kind, as the family does
        self.block = type(verifier.layers[-1])(config, weights.layer_index)
        self._fused = any(k.endswith("experts.gate_up_proj") for k in self.block.state_dict())
        # not registered: the verifier owns them (frozen); the drafter only reads them
        self.__dict__["_verifier"] = verifier
        self._own_copies(verifier, weights)
        self._names = set(weights.tensors)
        self._copies = {k: v for k, v in weights.tensors.items() if k[len(weights.prefix):] in SHARED_COPIES}
        if self.cfg.init == "shipped":
            self.load_checkpoint_tensors(weights.local())
        else:
            self.reset_parameters(config.initializer_range)
        self.to(device=verifier.device)

    def _own_copies(self, verifier, weights: MtpWeights) -> None:
        local = weights.local()
        head, embed = local.get("shared_head.head.weight"), local.get("embed_tokens.weight")
        vhead = verifier.lm_head.weight.detach().cpu()
        if weights.model_type == "glm4_moe" and head is not None and not torch.equal(head.to(vhead.dtype), vhead):
            raise MtpError(f"{weights.folder}: {weights.prefix}shared_head.head.weight differs from lm_head.weight; "
                           "vLLM's glm4_moe_mtp loads both into one head (whichever it reads last), so what it "
                           "serves is undefined: make them equal")
        for name, own, theirs in (("own_head", head, vhead),
                                  ("own_embed", embed, verifier.embed_tokens.weight.detach().cpu())):
            differs = own is not None and not torch.equal(own.to(theirs.dtype), theirs)
            self.register_buffer(name, own.clone() if differs else None, persistent=False)

    # ---- weights under the checkpoint's names ------------------------------------------------------------------------
    def load_checkpoint_tensors(self, local: dict[str, torch.Tensor]) -> None:
        """Load the layer's tensors (names inside the layer, as stored) strictly."""
        state = {}
        block = {k: v for k, v in local.items() if k not in MTP_PARTS and k not in SHARED_COPIES}
        for k in MTP_PARTS:
            state[k] = local[k]
        for k, v in fuse_experts(block, self._fused).items():
            state[f"block.{k}"] = v
        try:
            self.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()},
                                 strict=True)
        except RuntimeError as err:
            first = str(err).splitlines()[1].strip() if len(str(err).splitlines()) > 1 else str(err)
            raise MtpError(f"{self.folder}: its MTP layer does not fit {type(self.block).__name__} built from "
                           f"config.json: {first}") from None

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the layer under its full checkpoint name (the shared copies as they were read)."""
        prefix = f"model.layers.{self.layer_index}."
        state = {k: v.detach() for k, v in self.state_dict().items()}
        block = {k[len("block."):]: v for k, v in state.items() if k.startswith("block.")}
        names = {k[len(prefix):] for k in self._names}
        local = {**{k: state[k] for k in MTP_PARTS}, **split_experts(block, names)}
        return {**{prefix + k: v for k, v in local.items()}, **self._copies}

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """A fresh layer: the family's own initialisation for the block, N(0, std) for eh_proj, ones for the norms."""
        self.block.apply(self._verifier.model._init_weights)
        nn.init.normal_(self.eh_proj.weight, std=std)
        for m in self.modules():
            if m is not self and hasattr(m, "weight") and "norm" in type(m).__name__.lower():
                m.weight.fill_(1.0)

    # ---- the step ----------------------------------------------------------------------------------------------------
    @property
    def head_weight(self) -> torch.Tensor:
        return self.own_head if self.own_head is not None else self._verifier.lm_head.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.own_embed if self.own_embed is not None else self._verifier.embed_tokens.weight
        return embedding_rows(table, tokens)

    def attention_mask(self, position_ids: torch.Tensor) -> torch.Tensor | None:
        """None when every row is one document and the block's attention is causal by itself (sdpa); else an
        additive (B, 1, T, T) mask: causal within each document (position_ids restart at 0 per document)."""
        B, T = position_ids.shape
        plain = bool((position_ids == torch.arange(T, device=position_ids.device)).all())
        if plain and self._verifier.config._attn_implementation == "sdpa":
            return None
        doc = torch.cumsum((position_ids == 0).long(), -1)  # (B, T) document number
        causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
        allowed = causal & (doc[:, :, None] == doc[:, None, :])  # (B, T, T)
        dtype = self.eh_proj.weight.dtype
        return torch.zeros(B, 1, T, T, dtype=dtype, device=position_ids.device).masked_fill(
            ~allowed[:, None], torch.finfo(dtype).min)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output (B, T, H), before shared_head.norm, for tokens (B, T) (the token after each position)
        and hidden (B, T, H) (the verifier's final hidden state there, or the previous draft's output)."""
        dtype = self.eh_proj.weight.dtype
        e = self.embed(tokens).to(dtype)
        e = e.masked_fill((position_ids == 0)[..., None], 0.0)  # vLLM feeds no token embedding at position 0
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden.to(dtype))], -1))  # (B, T, H)
        cos_sin = self._verifier.decoder.rotary_emb(x, position_ids)
        out = self.block(x, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """(B, T, V) draft logits of layer outputs `out`."""
        x = self.shared_head.norm(out)
        return F.linear(x, self.head_weight.to(x.dtype))

    # ---- training ----------------------------------------------------------------------------------------------------
    def train_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, loss_mask: torch.Tensor,
                      labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> MtpOutput:
        """`cfg.steps` unrolled drafts from every position p: step k (0-based) reads x_{p+k+1} and step k-1's output
        (step 0: the verifier's h_p) and learns labels[p+k+1] (the token after position p+k+1), scored where the
        token it stands for, x_{p+k+2}, is in loss_mask and in p's document. Each step attends over the same step's
        outputs at earlier positions (at inference, steps after the first read the first step's): one layer forward
        per step over the whole row. input_ids, loss_mask, labels (B, T); hidden (B, T, H)."""
        B, T = input_ids.shape
        pos = position_ids if position_ids is not None else \
            torch.arange(T, device=input_ids.device).expand(B, T)
        mask = self.attention_mask(pos)
        weights = step_weights(self.cfg.steps, self.cfg.step_decay).tolist()
        loss = hidden.new_zeros((), dtype=torch.float32)
        step_losses, correct, valid = [], [], []
        h = hidden
        for k, w in enumerate(weights):
            tokens = shift_left(input_ids, k + 1)  # (B, T) x_{p+k+1}
            target = shift_left(labels, k + 1)  # (B, T) what should follow position p+k+1
            scored = shift_left(loss_mask, k + 2).bool() & (shift_left(pos, k + 1, fill=-1) == pos + k + 1)
            out = self(tokens, h, pos, mask)  # (B, T, H)
            n = scored.sum().clamp(min=1)
            part = linear_loss(self.shared_head.norm(out).flatten(0, 1), self.head_weight, target.flatten(),
                               scored.flatten().float() * (w / n), argmax=True)
            loss = loss + part.loss
            step_losses.append(part.ce.detach() / w)
            correct.append(part.argmax.view(B, T) == target)
            valid.append(scored)
            h = out
        return MtpOutput(loss, torch.stack(step_losses), step_counts(torch.stack(correct), torch.stack(valid)))


def build_mtp_drafter(verifier, weights: MtpWeights | None = None, cfg: MtpConfig | None = None) -> MtpDrafter:
    """The MTP layer of `weights` (default: read from the verifier's own folder) as a drafter for `verifier`."""
    from draftheads.models.layouts.mtp_checkpoint import read_mtp_layer

    if weights is None:
        if verifier.path is None:
            raise MtpError(f"verifier {verifier.name!r} was not loaded from a folder: give the checkpoint folder "
                           "that holds its MTP layer")
        weights = read_mtp_layer(verifier.path)
    return MtpDrafter(verifier, weights, cfg)
