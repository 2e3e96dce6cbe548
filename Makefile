# Two entry points for a fresh machine: `make demo` (`rocm-k3 demo` on the embedded tiny K3) and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test toolchain test-cuda test-rocm clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU machines take the pinned CPU wheel; a GPU host keeps the ROCm/CUDA torch already in the venv.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	# nixl: NixlConnector's NIXL/UCX (a 68 MB wheel, Linux x86_64 only) so CI runs both PD transports.
	$(BIN)/pip install -q -e '.[test,kernels,serve,nixl]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/rocm-k3 demo

# lld-19 for FlyDSL's compile-only link (the `compile` tier); best effort, the tier skips with a reason without it.
toolchain:
	bash scripts/ensure_lld.sh || true

# One pytest process per test area (tests/<area>/), the areas in two lanes side by side (TEST_LANES=1: one after
# another), tcmalloc preloaded when installed (TEST_MALLOC=system: glibc's): see scripts/test_areas.sh. Every area
# runs even when one fails; the exit status is non-zero if any failed.
test: $(STAMP) toolchain
	@bash scripts/test_areas.sh $(BIN)/python

test-cuda: $(STAMP)
	$(BIN)/python -m pytest -q -m cuda

test-rocm: $(STAMP)
	$(BIN)/python -m pytest -q -m rocm

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
