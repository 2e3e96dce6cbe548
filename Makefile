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

# One pytest process per test area (tests/<area>/): the memory an area's in-process engines keep (allocator caches,
# NIXL/UCX agents, compiled grammars) goes back to the system before the next area starts. Every area runs even
# when one fails; the exit status is non-zero if any failed (5, "no tests collected", is not a failure).
test: $(STAMP) toolchain
	@fail=0; for d in tests/*/; do \
	  case $$d in *__pycache__*) continue;; esac; \
	  echo "== $$d"; $(BIN)/python -m pytest -q -p no:cacheprovider $$d || [ $$? -eq 5 ] || fail=1; \
	done; exit $$fail

test-cuda: $(STAMP)
	$(BIN)/python -m pytest -q -m cuda

test-rocm: $(STAMP)
	$(BIN)/python -m pytest -q -m rocm

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
