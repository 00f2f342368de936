#!/usr/bin/env bash
# Create .venv and install cpshard with its test extra. torch is pinned and installed first so that
# pip never resolves an unpinned torch (which would download a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${CPSHARD_TORCH:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'

# verl 0.9.1 + megatron-core 0.19.2 for the adapters' differential tests (tests/test_verl_compat.py,
# tests/test_megatron_packed.py). Every package pinned and --no-deps, so pip never resolves torch;
# the list is what `import verl.models.mcore.model_forward` needs on a CPU machine. CPSHARD_NO_VERL=1 skips it.
if [ "${CPSHARD_NO_VERL:-0}" != 1 ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check numpy 'packaging>=24.2'
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --ignore-requires-python \
    megatron-core==0.19.2
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps verl==0.9.1 \
    ray==2.60.0 tensordict==0.10.0 transformers==5.10.4 omegaconf==2.4.0 codetiming==1.4.0 \
    msgpack==1.2.4 protobuf==7.36.2 pyyaml==6.0.4 requests==2.34.2 urllib3==2.8.0 idna==3.20 \
    certifi==2026.10.19.post1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 attrs==26.1.0 \
    referencing==0.37.0 rpds-py==2026.9.1 pyvers==0.2.3 cloudpickle==3.1.3 regex==2026.11.19 \
    huggingface-hub==1.33.0 tokenizers==0.22.2 safetensors==0.8.0 tqdm==4.70.1 httpx==0.28.1 \
    httpcore==1.0.9 h11==0.16.0 orjson==3.13.0 filelock==4.3.1 fsspec==2026.9.0 charset-normalizer==3.5.3
fi
