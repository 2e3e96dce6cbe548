#!/usr/bin/env bash
# `make test`: one pytest process per test area (tests/<area>/), TEST_LANES of them at a time (default: the CPU count,
# at most 2). An area's own process means the memory its in-process engines keep (allocator caches, NIXL/UCX
# agents, compiled grammars) goes back to the system when it ends. Areas start longest first (the order below, from
# CI's per-area times; an area not named starts after them), each next one when a lane frees, and each area's output
# is printed whole when it ends. Every area runs even when one fails; the exit status is 1 if any failed (pytest's 5,
# "no tests collected", is not a failure).
#   env: PY (default .venv/bin/python), TEST_LANES, PYTEST_ARGS (extra pytest arguments, word-split)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LONGEST_FIRST=(kernels engine serve parallel model training package kv_transfer)
lanes=${TEST_LANES:-$(nproc 2>/dev/null || echo 1)}
if ! [[ "$lanes" =~ ^[1-9][0-9]*$ ]]; then
  echo "TEST_LANES must be a positive integer, got '$lanes'" >&2
  exit 2
fi
((lanes > 2)) && [ -z "${TEST_LANES:-}" ] && lanes=2
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

areas=()
for a in "${LONGEST_FIRST[@]}"; do
  [ -d "tests/$a" ] && areas+=("$a")
done
for d in tests/*/; do
  a=$(basename "$d")
  [ "$a" = __pycache__ ] && continue
  [[ " ${areas[*]} " == *" $a "* ]] || areas+=("$a")
done

run_area() {  # run_area AREA: its pytest output printed whole at the end; exit 1 on failure
  local a=$1 t0=$SECONDS rc
  # shellcheck disable=SC2086
  "$PY" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} "tests/$a" >"$logs/$a.log" 2>&1
  rc=$?
  {
    flock 9
    echo "== tests/$a/ (rc $rc, $((SECONDS - t0)) s)"
    cat "$logs/$a.log"
  } 9>"$logs/.print.lock"
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ]
}
export -f run_area
export PY logs
echo "test areas, $lanes at a time: ${areas[*]}"
t0=$SECONDS
printf '%s\n' "${areas[@]}" | xargs -P "$lanes" -I{} bash -c 'run_area "$1"' _ {}
rc=$?
echo "== all areas done in $((SECONDS - t0)) s"
[ "$rc" -eq 0 ] && exit 0
echo "some test area failed (see its rc above)" >&2
exit 1
