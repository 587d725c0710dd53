# Sourced by scripts/gpu_check.sh and scripts/gpu_train_check.sh: the wheels that travel to a lent GPU machine (no
# network there) and their install on it. Sets $PY ($PYTHON, default python3): the Python the checks run with, whose
# package versions the wheels pin.
PY=${PYTHON:-python3}
#
# The device image (Python 3.12, x86-64) has transformers 5.17 and huggingface_hub 1.33; pyproject needs
# transformers >= 5.20, which needs hub 2.x (and hub 2.x httpx2, kernels, newer click/regex/tokenizers). Each goes
# as a wheel at this environment's version; the image's own torch, triton, numpy, pytest stay.
GPU_WHEELS="transformers huggingface_hub kernels tomlkit httpx2 httpcore2 truststore h11 idna anyio typing_extensions
  hf_xet click regex tokenizers accelerate safetensors setuptools"

download_wheels() {  # download_wheels DIR NAME...: DIR (emptied) gets each NAME's wheel at $PY's version, for the device
  local dir=$1 pins
  shift
  pins=$("$PY" -c "import sys, importlib.metadata as m; print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" \
    "$@") || return 1
  rm -rf "$dir" && mkdir -p "$dir"
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" $pins
}

install_wheels() {  # install_wheels DIR SITE: DIR's wheels (if any) into SITE, first on PYTHONPATH; then the package
  if compgen -G "$1/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl \
      || return 1
    export PYTHONPATH=$2:$PWD
  fi
  # The namespace: draftheads/models links to models/ and so on, so the checkout on PYTHONPATH imports it; where
  # it is not, an editable install, as on a developer's machine.
  "$PY" -c "import draftheads.models.verifier" 2>/dev/null || "$PY" -m pip install -q --no-index --no-deps \
    --no-build-isolation --no-cache-dir -e .
}
