"""The engines themselves: vLLM and SGLang runners (each run in its own venv, they import nothing of ours), vLLM as
a decoding peer, and serve-check."""
