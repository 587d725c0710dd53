"""DFlash2 drafters in vLLM's layout: z-lab's DFlash layout (dflash_vllm.py) with vLLM 0.32's DFlash2 additions
(read from `model_executor/models/qwen3_dflash2.py`, `v1/worker/gpu/spec_decode/dflash2/speculator.py`,
`config/vllm.py`).

  config  architectures ["DFlash2DraftModel"] (the name vLLM's registry maps to `DFlash2Qwen3ForCausalLM`), and in
          dflash_config, beside mask_token_id and target_layer_ids: conv_kernel_size (taps), conv_group_size,
          selector_rank, selector_top_k (all four required by vLLM). input_embedding_scale, output_multiplier and
          final_logit_softcapping are not written: vLLM's defaults (1, 1, none) are how the drafter trains.
  weights DFlash's, plus per layer i layers.i.{attention_conv,mlp_conv}.base_kernel [2, taps, H] and
          .kernel_projection.weight [2 * taps * H / conv_group_size, H], and candidate_selector.
          {predecessor_codebook, successor_codebook} [V, rank], candidate_selector.hidden_projection.weight [rank, H].

What vLLM does with the folder:
  - Serving: speculative_config {"method": "dflash", "model": FOLDER, "num_speculative_tokens": K}; the
    architecture picks the DFlash2 speculator, which exists only in the V2 model runner (config/vllm.py lists
    "DFlash candidate-head drafts" as unsupported on V1; on V1 the same folder would draft through the plain DFlash
    proposer, the convolutions running but the selector never called). The convolutions read blocks of
    1 + K query tokens: serve with K = block_size - 1, the block the drafter was trained on.
  - The selector: the lm_head's top selector_top_k tokens at each mask position (their raw logits), scored after
    each candidate of the previous position (the anchor for the first), walked left to right (greedy: argmax;
    sampling: a Gumbel draw from the realized row, which is also the draft distribution the rejection reads).
  - The grouped convolution has a Triton kernel for CUDA tensors and a torch path for all others (the CPU's).
"""

from __future__ import annotations

ARCHITECTURE = "DFlash2DraftModel"
#: dflash_config fields vLLM's DFlash2 reads (DFlashConfig names them the same).
FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def dflash_config(cfg) -> dict:
    """The dflash_config entries a DFlash2 drafter adds."""
    return {key: int(getattr(cfg, key)) for key in FIELDS}
