#!/usr/bin/env bash
# `make test`: one pytest process per test area (tests/<area>/), the areas spread over TEST_LANES lanes that run side
# by side (default 2: CI's two cores; most areas keep one core busy; RESULTS.md, "CI time"). Each area's output
# goes to its own log, printed whole when the area ends (one area at a time, so lanes never interleave lines).
# Every area runs even when one fails; the exit status is 1 if any failed (pytest's 5, "no tests collected", is not a
# failure). An area is its own process so that the memory its in-process engines keep (allocator caches, NIXL/UCX
# agents, compiled grammars) goes back to the system when it ends.
# TEST_MALLOC=tcmalloc (the default when libtcmalloc_minimal is installed; .ci/run installs it) preloads it into
# every test process and the servers and ranks they start: glibc's allocator hands the engines' large per-step
# buffers back to the kernel and faults them in again on every step (one spec-decode engine test: 1.62 M minor faults
# and 29.8 s with glibc's, 0.14 M and 25.7 s with tcmalloc).
# Usage: scripts/test_areas.sh PYTHON [AREA ...]   (no area: every tests/<area>/)
set -uo pipefail
py=${1:?usage: scripts/test_areas.sh PYTHON [AREA ...]}
shift
lanes=${TEST_LANES:-2}
case $lanes in ''|*[!0-9]*|0) echo "TEST_LANES must be a positive integer, got '$lanes'" >&2; exit 2;; esac

if [ "${TEST_MALLOC:-tcmalloc}" = tcmalloc ]; then
  for lib in /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4; do  # .ci/run's check has the same pattern
    if [ -e "$lib" ]; then export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"; echo "tests run with $lib"; break; fi
  done
fi

if [ $# -gt 0 ]; then areas=("$@"); else
  areas=()
  for d in tests/*/; do
    a=$(basename "$d")
    [ "$a" = __pycache__ ] || areas+=("$a")
  done
fi

# Seconds per area on CI's 2-core machine, one lane (session 27's clean-clone run): the longest first, each to the
# lane with the least work so far. An area not listed counts 30 s.
weight() {
  case $1 in
    kernels) echo 620;; engine) echo 590;; serve) echo 530;; parallel) echo 330;; model) echo 120;;
    training) echo 106;; package) echo 103;; kv_transfer) echo 28;; structured) echo 18;; worker) echo 18;;
    formats) echo 12;; ops) echo 12;; integrations) echo 3;; cache) echo 1;; *) echo 30;;
  esac
}
sorted=$(for a in "${areas[@]}"; do echo "$(weight "$a") $a"; done | sort -rn | awk '{print $2}')
declare -a load plan
for ((i = 0; i < lanes; i++)); do load[i]=0; plan[i]=""; done
for a in $sorted; do
  best=0
  for ((i = 1; i < lanes; i++)); do [ "${load[i]}" -lt "${load[best]}" ] && best=$i; done
  load[best]=$((load[best] + $(weight "$a")))
  plan[best]="${plan[best]} $a"
done

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
run_lane() {
  local lane=$1 a rc start
  shift
  for a in "$@"; do
    start=$SECONDS
    "$py" -m pytest -q -p no:cacheprovider "tests/$a/" > "$logs/$a.log" 2>&1
    rc=$?
    echo "$rc" > "$logs/$a.rc"
    {
      flock 9
      echo "== tests/$a/ (lane $lane, $((SECONDS - start)) s, exit $rc)"
      cat "$logs/$a.log"
    } 9> "$logs/print.lock"
  done
}
for ((i = 0; i < lanes; i++)); do
  [ -n "${plan[i]}" ] && echo "lane $i:${plan[i]}"
done
pids=()
for ((i = 0; i < lanes; i++)); do
  # shellcheck disable=SC2086  # the plan is a list of area names
  [ -n "${plan[i]}" ] && { run_lane "$i" ${plan[i]} & pids+=($!); }
done
wait "${pids[@]}"

fail=0
for a in "${areas[@]}"; do
  rc=$(cat "$logs/$a.rc" 2>/dev/null || echo missing)
  case $rc in 0|5) ;; *) echo "FAILED: tests/$a/ (exit $rc)"; fail=1;; esac
done
exit $fail
