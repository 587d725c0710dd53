#!/usr/bin/env bash
# Make .venv-sglang/: an environment in which SGLang 0.5.23's own model-construction and weight-loading code runs
# on a CPU (eval/interop/sglang_runner.py), for the opt-in SGLang interop test (tests/e2e/interop/test_sglang.py). SGLang's
# server cannot run here (its wheel requires the CUDA stack; its CPU kernel package is not on PyPI), but its loader
# can: the wheel is unpacked and put on sys.path (never pip-installed, so none of its CUDA requirements come in),
# beside a CPU torch, triton and the pure-Python packages its loader imports (pinned as tested). Two names that
# cannot be installed are stood in for by eval/interop/sglang_stubs.py: torchvision (only multimodal modules import it) and
# vllm / vllm._custom_ops (CUDA kernels SGLang's fallbacks store for forward()). Idempotent (a stamp); ~2.2 min and
# 2.5 GB from scratch. On failure one line naming the step and the log.
#   bash scripts/setup_sglang.sh && DRAFTHEADS_SGLANG=1 bash scripts/test.sh tests/e2e/interop/test_sglang.py
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=.venv-sglang
py=${SGLANG_PYTHON:-python3.11}
stamp=$root/.draftheads-sglang-installed
want=$(cat scripts/setup_sglang.sh | sha256sum | cut -c1-16)
if [ -x "$root/venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null || true)" = "$want" ]; then
  echo "[setup_sglang] $root is ready (stamp $want)"
  exit 0
fi
# shellcheck source=scripts/setup_step.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup_step.sh" setup_sglang  # $log and step
command -v "$py" >/dev/null 2>&1 || { echo "[setup_sglang] FAILED: $py not found (set SGLANG_PYTHON)" >&2; exit 1; }
echo "[setup_sglang] making $root (SGLang 0.5.23's loader on a CPU; ~2.2 min, 2.5 GB); log: $log"
rm -f "$stamp"
mkdir -p "$root"
[ -x "$root/venv/bin/python" ] || step "create venv" "$py" -m venv "$root/venv"
pip=("$root/venv/bin/python" -m pip)
step "download the sglang wheel" "${pip[@]}" download -q --no-deps -d "$root/wheel" sglang==0.5.23
rm -rf "$root/src" && mkdir -p "$root/src"
step "unpack it" "$root/venv/bin/python" -m zipfile -e "$(ls "$root"/wheel/sglang-0.5.23-*.whl)" "$root/src"
step "torch (CPU) and triton" "${pip[@]}" install -q torch==2.13.0 triton==3.9.0
cat > "$root/requirements.txt" <<'REQ'
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
apache-tvm-ffi==0.1.11
asttokens==3.0.2
attrs==26.1.0
certifi==2026.10.19.post1
charset-normalizer==3.5.3
click==8.5.1
compressed-tensors==0.18.0
dill==0.4.1
distro==1.9.0
einops==0.8.2
executing==2.3.0
fastapi==0.165.0
filelock==4.3.1
frozenlist==1.8.0
fsspec==2026.9.0
gguf==0.19.0
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpcore2==2.16.2
httpx==0.28.1
httpx2==2.16.2
huggingface_hub==2.4.0
idna==3.20
ipython==9.18.1
ipython_pygments_lexers==1.1.1
jedi==0.20.1
Jinja2==3.1.6
jiter==0.19.0
loguru==0.7.3
markdown-it-py==4.3.0
MarkupSafe==3.0.4
matplotlib-inline==0.2.2
mdurl==0.1.2
mpmath==1.3.0
msgspec==0.23.0
multidict==7.2.1
networkx==3.6.1
numpy==2.4.6
openai==2.8.0
opentelemetry-api==1.45.2
orjson==3.13.0
packaging==26.4
parso==0.8.7
partial-json-parser==0.2.1.1.post7
pexpect==4.9.0
pillow==13.0.0
prompt_toolkit==3.0.53
propcache==0.5.4
psutil==7.2.2
ptyprocess==0.7.0
pure_eval==0.2.4
pybase64==1.5.1
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
PyYAML==6.0.4
pyzmq==27.3.0
regex==2026.11.19
requests==2.34.2
rich==15.0.0
safetensors==0.8.0
sentencepiece==0.2.1
shellingham==1.5.4
sniffio==1.3.1
stack-data==0.6.3
starlette==1.10.0
sympy==1.14.0
tokenizers==0.23.3
tqdm==4.70.1
traitlets==5.16.1
transformers==5.19.0
truststore==0.10.5
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0
urllib3==2.8.0
uvicorn==0.54.0
wcwidth==0.9.4
yarl==1.25.1
REQ
step "what its loader imports" "${pip[@]}" install -q -r "$root/requirements.txt"
step "import check" env PYTHONPATH="$root/src" "$root/venv/bin/python" -W ignore -c "
import importlib.util, sys
spec = importlib.util.spec_from_file_location('_sglstub', 'eval/interop/sglang_stubs.py'); stub = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stub); stub.install(trees=['torchvision'], exact=['vllm', 'vllm._custom_ops'])
import sglang.srt.models.llama_eagle3, sglang.srt.models.llama_eagle"
echo "$want" >"$stamp"
rm -f "$log"
echo "[setup_sglang] ready: $root/venv/bin/python with SGLang 0.5.23's loader in $root/src"
