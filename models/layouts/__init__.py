"""Engine layouts: how a drafter is written so that an inference engine loads it as trained.

One module per (method, engine) flavour; each turns a trained drafter into `config.json` fields and tensors under
the engine's names, and back:

    medusa_vllm     Medusa heads for vLLM's `MedusaModel` (our engine reads the same folder)
    eagle_vllm      EAGLE-1 / EAGLE-3 for vLLM's `EagleLlamaForCausalLM` / `LlamaForCausalLMEagle3`
    eagle_sglang    EAGLE-1 / EAGLE-3 for SGLang's `LlamaForCausalLMEagle` / `LlamaForCausalLMEagle3`

`folder.py` holds what they share (the folder on disk, the `draftheads` metadata block, reads that name the file
and key). `models/export.py` is the one entry point that picks a layout; adding a flavour adds a module here and a
line there, and touches no model code.
"""
