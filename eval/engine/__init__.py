"""The engine: the decoder (draft -> verify in one forward -> accept -> commit), the one decode loop, the drafter
protocol (typed step rows), the runtimes (static KV cache, generic), draft trees, acceptance, the kernels and the
fused CUDA loop. It runs any `Drafter` it is handed and imports no drafter, no measurement and no interop."""
