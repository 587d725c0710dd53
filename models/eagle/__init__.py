"""EAGLE-1 and EAGLE-3 drafters: one decoder layer on the frozen verifier's features.

Notation. A training sequence is x_0 .. x_{T-1}. The verifier, run once over it, gives at position t
  f_t        its final post-norm hidden state (input of lm_head); q_t = lm_head(f_t) predicts x_{t+1};
  g_t^(i)    the input of decoder layer i (HF `hidden_states[i]`), for the EAGLE-3 feature layers i.
`loss_mask[b, t] = 1` marks x_t as a token the drafter should learn to predict (assistant tokens; 0 on prompts
and padding). A prediction *of* x_j is trained and scored iff loss_mask[j] = 1. Padding goes on the right.

EAGLE-1 (Li et al. 2024; SafeAILab/EAGLE `eagle/train/main.py`, `cnets1.py`)
  At drafter position t (position id t) the input pair is (x_{t+1}, f_t):
      f'_t = Layer(fc([embed(x_{t+1}); f_t]))                 fc = Linear(2H, H, bias=fc_bias), no bias by default
  Layer is one decoder layer of the verifier's family (Llama's for families other than Llama, Qwen2 and Mistral,
  `llama_layer_config`) *without* input_layernorm (the fc output is the residual);
  there is no final norm: f'_t is fed straight to the verifier's lm_head. f'_t regresses f_{t+1}, and
  lm_head(f'_t) predicts x_{t+2}:
      loss = feature_weight * SmoothL1(f'_t, f_{t+1}) + token_weight * CE(softmax(q_{t+1}), log_softmax(lm_head(f'_t)))
  averaged over positions with loss_mask[t+2] = 1 (SmoothL1 averaged over H first, as the EAGLE repo does; that repo
  leaves the mask unshifted, scoring x_{t+2} with loss_mask[t]).
  Optional noise: f_t + (U(0,1) - 0.5) * noise on the *input* features only (the EAGLE repo uses 0.2 * 512/T).

EAGLE-3 (Li et al. 2025; SafeAILab/EAGLE `eagle/traineagle3/cnets.py`, sgl-project/SpecForge
`specforge/algorithms/eagle3/model.py`, `specforge/modeling/draft/llama3_eagle.py`)
  Features: h_t = fc([g_t^(a); g_t^(b); g_t^(c)]), fc = Linear(3H, H, bias=False), layers (a, b, c) default
  `verifier.default_eagle3_layers()` = inputs of layers 2, L//2, L-3 (vLLM's default).
  Layer(e, h): residual = h (or hidden_norm(h) when norm_before_residual)
               a = Attn(cat[input_layernorm(e); hidden_norm(h)])      q/k/v take 2H, o_proj gives H
               u = residual + a;  out = u + MLP(post_attention_layernorm(u))
  out is the drafter's hidden (fed back at the next step, *pre*-norm); logits = lm_head(norm(out)) over a draft
  vocabulary of size Vd, mapped to verifier ids by `target_id = draft_id + d2t[draft_id]`.

  Training-time test (TTT), steps k = 0 .. K-1 (K = ttt_steps), stream position t:
      step 0:  input (x_{t+1}, h_t)              at position id t
      step k:  input (x_{t+1+k}, out^{k-1}_t)    at position id t + k
      out^k_t predicts x_{t+2+k}; target softmax of q_{t+1+k} renormalised over the draft vocabulary; trained iff
      loss_mask[t+2+k] = 1 and argmax q_{t+1+k} is in the draft vocabulary.
      Attention of query (k, t) sees keys (0, s) for s <= t (the step-0 prefix, causally) and (j, t) for
      1 <= j <= k (its own chain). This is exactly what inference does: the drafter's KV cache holds step-0 entries
      for the verified prefix 0..t, then one entry per drafted token of this chain at positions t+1, t+2, ...
      loss = sum_k decay^k * mean over trained positions of soft-CE_k           (decay = 0.8)
  The EAGLE repo and SpecForge pair the same (token, hidden) inputs, shift targets one per step and add the step
  index to the position ids (`position_ids + lck`). They shift `loss_mask` by k only (scoring x_{t+2+k} with
  loss_mask[t+k]); here the mask is shifted to the predicted token itself, per the convention above.

  Implementation of the TTT attention: by definition, step k attends over the keys of all steps so far concatenated
  along the sequence, [K_0 | K_1 | ... | K_k] of length (k+1)T, with the boolean mask `ttt_attention_mask(T, k)` =
  [causal | I | ... | I]. Most of that mask is False, so `ttt_attention` computes the same thing in memory linear in
  T: causal attention over K_0 through a kernel that returns its log-sum-exp (flash on the CPU and CUDA; a
  query-chunked torch one elsewhere), plus one score per later step against the query's own key (q_t . k_j,t)
  (B, nh, T, k), the two merged by their log-sum-exp. Step 0 is the prefix alone. Packed rows pass per-token
  document ids, not a (T, T) mask (models/eagle/ttt.py).

EAGLE-3 variants (each an `EagleConfig` switch, exported with the fields vLLM reads: models/layouts/eagle_vllm.py)
  parallel (P-EAGLE, arXiv 2602.01469; vLLM `parallel_drafting`): step k >= 1 reads (mask token, fc(mask_hidden))
      instead of (x_{t+1+k}, out^{k-1}_t), at position id t + k with the same TTT attention (the step-0 prefix
      causally, then its own chain's mask positions). Nothing a step reads depends on an earlier step's output, so
      at inference all K drafts come from one drafter forward over the committed pairs followed by K-1 mask
      positions. mask_hidden (3H) lives in the verifier-feature space and goes through fc (and fc_norm) like a
      feature, as vLLM computes it; the mask token's embedding is the verifier's, frozen. Training keeps a
      random nested share max(decay^k, floor) of the chains at step k (`parallel_keep`, as speculators samples).
  fc_norm (EAGLE 3.1): h_t = fc([n_a(g^(a)); n_b(g^(b)); n_c(g^(c))]), one RMS norm per feature layer.
  norm_output (EAGLE 3.1): the layer's output is norm(out), which is both what the next step reads and what
      lm_head reads (logits apply no second norm).
Token losses and step weights: models/draft_losses.py (`loss`, `step_weights`); forward_kl is the soft CE above.

Metrics (on device, summed over batches as `StepCounts`): per step k, accuracy acc_k (greedy draft token equals the
verifier's argmax, among positions with loss_mask[t+2+k] = 1, out-of-draft-vocab targets counting as misses),
conditional accuracy c_k = P(step k right | steps 0..k-1 right at that position), cumulative
accuracy prod_{j<=k} c_j, and the simulated acceptance length 1 + sum_k prod_{j<=k} c_j (bonus token included).
EAGLE-3's `training_loss` counts its K = ttt_steps steps; EAGLE-1's counts its one trained step, and
`chain_counts(..., steps)` scores either version on chains it drafts from its own outputs (EAGLE-1 at inference).

Inference API (for the spec-decode engine), the same for both versions:
  drafter(input_ids (B,N), hidden (B,N,H), position_ids (B,N) | None, attention_mask | None,
          past_key_value (k, v) | None) -> (out_hidden (B,N,H), (k, v))
    hidden          EAGLE-1: the verifier's final feature f_t or the drafter's own previous out_hidden.
                    EAGLE-3: `project_features(...)` of verifier features, or the drafter's own previous
                    out_hidden; raw (B,N,3H) verifier features are projected on the fly.
    attention_mask  (B or 1, 1, N, S_past + N), bool (True = attend) or additive float; None = causal over the new
                    tokens with the whole cache visible. Trees: ancestor-only masks with position id = depth.
    past_key_value  (k, v), each (B, num_kv_heads, S_past, head_dim), keys already rotated (RoPE). The return value
                    is the cache extended by the N new entries, (B, num_kv_heads, S_past + N, head_dim).
  drafter.logits(out_hidden) -> (B,N,V) for EAGLE-1 (the verifier's lm_head, no extra norm), (B,N,Vd) for EAGLE-3.
  drafter.to_target_ids(draft_ids) -> verifier ids (identity for EAGLE-1).
  drafter.project_features(list of (B,T,H)) -> (B,T,H): EAGLE-3's fc; EAGLE-1 returns its single final feature.
  drafter.feature_layers: the verifier layer ids to request (EAGLE-1: none, it uses the final feature).

Export and load: models/export.py (`export_eagle`, `load_eagle`), in the layouts of models/layouts/ (vLLM's,
SGLang's); this module holds the drafter, its losses and math only.
"""

from draftheads.models.eagle.config import EagleConfig, EagleError  # noqa: F401
from draftheads.models.eagle.drafter import (  # noqa: F401
    Eagle1Drafter,
    Eagle3Drafter,
    EagleDrafter,
    build_drafter,
    resolve_mask_token,
)
from draftheads.models.eagle.layer import (  # noqa: F401
    OWN_LAYER_FAMILIES,
    _family,
    _Held,
    _layer_config,
    llama_layer_config,
    norm_scale,
)
from draftheads.models.eagle.losses import (  # noqa: F401
    add_uniform_noise,
    chunked_draft_targets,
    draft_targets,
    eagle1_loss,
    row_draft_targets,
)
from draftheads.models.eagle.metrics import EagleOutput, StepCounts, step_counts  # noqa: F401
from draftheads.models.eagle.train import EagleTrainModule  # noqa: F401
from draftheads.models.eagle.ttt import ttt_attention, ttt_attention_mask  # noqa: F401
from draftheads.models.eagle.vocab import (  # noqa: F401
    count_tokens,
    draft_to_target,
    select_draft_vocab,
    target_to_draft,
)
