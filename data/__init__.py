"""Data: text in, token batches out (sources, chat templates and loss masks, packing, regeneration, eval prompts)."""
