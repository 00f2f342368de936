#!/usr/bin/env bash
# Create .venv and install cpshard with its test extra. torch is pinned and installed first so that
# pip never resolves an unpinned torch (which would download a multi-GB CUDA build).
#
# megatron-core (for the Megatron interop tests) goes in without its dependencies (--no-deps: pip
# must never resolve torch): 0.19.2 into .venv, and 0.16.0 into .venv-mcore016, a --target folder
# that scripts/test.sh puts first on PYTHONPATH for a second run of the MTP tests. Set
# CPSHARD_MEGATRON=0 to skip both (those tests then skip, naming the reason).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${CPSHARD_TORCH:-torch==2.13.0}
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
"${PIP[@]}" "$TORCH_SPEC"
"${PIP[@]}" -e '.[test]'
if [ "${CPSHARD_MEGATRON:-1}" != "0" ]; then
  "${PIP[@]}" numpy 'packaging>=24.2'
  "${PIP[@]}" --no-deps --ignore-requires-python megatron-core==0.19.2
  if [ ! -d .venv-mcore016/megatron_core-0.16.0.dist-info ]; then
    rm -rf .venv-mcore016
    "${PIP[@]}" --no-deps --ignore-requires-python --target .venv-mcore016 megatron-core==0.16.0
  fi
fi
# verl 0.9.1 for the adapters' differential tests (tests/test_verl_compat.py). Every package pinned
# and --no-deps, so pip never resolves torch; the list is what `import verl.models.mcore.model_forward`
# needs on a CPU machine. CPSHARD_NO_VERL=1 skips it.
if [ "${CPSHARD_NO_VERL:-0}" != 1 ]; then
  "${PIP[@]}" --no-deps verl==0.9.1 \
    ray==2.60.0 tensordict==0.10.0 transformers==5.10.4 omegaconf==2.4.0 codetiming==1.4.0 \
    msgpack==1.2.4 protobuf==7.36.2 pyyaml==6.0.4 requests==2.34.2 urllib3==2.8.0 idna==3.20 \
    certifi==2026.10.19.post1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 attrs==26.1.0 \
    referencing==0.37.0 rpds-py==2026.9.1 pyvers==0.2.3 cloudpickle==3.1.3 regex==2026.11.19 \
    huggingface-hub==1.33.0 tokenizers==0.22.2 safetensors==0.8.0 tqdm==4.70.1 httpx==0.28.1 \
    httpcore==1.0.9 h11==0.16.0 orjson==3.13.0 filelock==4.3.1 fsspec==2026.9.0 charset-normalizer==3.5.3
fi
