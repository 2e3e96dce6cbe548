#!/usr/bin/env bash
# The H200 measurements issues #32, #33 and #35 wait on, in one `run` call (scripts/h200_pending.md says how to
# stage .carry/peers, the exact call, and where each result goes). Each part writes $OUT/<part>.txt under its own
# `timeout`, in priority order; a part gets min(its cap, time left - what the later parts are promised), so a slow
# part cannot eat the rest.
#
#   bash scripts/h200_pending.sh [part ...]   parts (default all, in this order): slice spec_b1 spec_b8 spec_b32
#                                             e2e kda cuda_tier; on request: e2e_async (bench_e2e
#                                             --async-scheduling), kda_phase (bench_kda --phase-compare),
#                                             cuda_new (the cuda tests of session 14's merges), kda_ncu
#                                             (Nsight Compute over the KDA prefill kernels at T = 16k), kda_prof
#                                             (bench_kda --profile-only: per kernel, default vs PROFILE_VARIANTS
#                                             vs FLA), kda_prep (bench_kda --prep-compare), cuda_prep (the K3
#                                             prefill cuda tests of the products and solve-in-walk paths),
#                                             cuda_kda (every
#                                             KDA prefill cuda test but of the paths measured slower), cuda_lean
#                                             (the K3 prefill cuda tests of session 20's byte cuts), cuda_logits
#                                             (the bf16 teacher-forced logits tests, on the slice part's
#                                             checkpoint), op_errors (scripts/bf16_op_errors.py on it), moe_prefill
#                                             (bench_moe at T = 512 / 2048: the prefill rows' MMA%), kda_error
#                                             (scripts/kda_prefill_error.py: o and states against the reference op)
#   env: OUT (required), BUDGET (seconds this script may use, default 570), CARRY (default .carry/peers),
#        CK (slice checkpoint dir, default /tmp/k3-slice), DRY=1 (print each part's command and timeout, run none);
#        CPU dry runs only: SLICE_WIDTH (slice widths divided by this, default 1 = K3 width), DEVICE (bench_spec's
#        device, default cuda); CAP_<part> / KEEP_<part> override a part's cap / the seconds it keeps for later parts
#        (a second call for one part: CAP_spec_b32=560 KEEP_spec_b32=0 bash scripts/h200_pending.sh slice spec_b32)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder the results go to}"
BUDGET=${BUDGET:-570}
CARRY=${CARRY:-.carry/peers}
CK=${CK:-/tmp/k3-slice}
DRY=${DRY:-0}
SLICE_WIDTH=${SLICE_WIDTH:-1}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
# FLA (bench_kda's peer) goes to its own folder, on the path of the bench_kda parts only: where it is importable,
# the device image's transformers runs its Kimi Linear reference through FLA's Triton kernels even on CPU tensors,
# which fails the cuda tests that compare against transformers (session 19).
FLA_SITE=${FLA_SITE:-/tmp/rocm_k3_fla_site}
start=$SECONDS
mkdir -p "$OUT"
export PYTHONPATH=".:$CARRY/peer/vllm/third_party${PYTHONPATH:+:$PYTHONPATH}"
PEER=(env "PYTHONPATH=$FLA_SITE:$PYTHONPATH" "$PY")

part() {  # part NAME CAP RESERVE CMD... : run CMD under timeout min(CAP, left - RESERVE), output to $OUT/NAME.txt
  local name=$1 cap_var="CAP_$1" keep_var="KEEP_$1"
  local cap=${!cap_var:-$2} reserve=${!keep_var:-$3}
  shift 3
  local left=$((BUDGET - (SECONDS - start)))
  local t=$((left - reserve < cap ? left - reserve : cap))
  if ((t < 20)); then
    echo "== $name skipped: ${left} s left, ${reserve} s kept for the later parts" | tee "$OUT/$name.txt"
    return
  fi
  echo "== $name (timeout ${t} s, at +$((SECONDS - start)) s): $*" | tee "$OUT/$name.txt"
  [ "$DRY" = 1 ] && return
  local t0=$SECONDS
  timeout -s INT -k 5 "$t" "$@" >>"$OUT/$name.txt" 2>&1
  echo "== $name: rc $? after $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt"
}

SLICE_PY='
import os, shutil, sys, time
from rocm_k3.model.tiny import k3_slice_overrides, write_tiny_checkpoint
ck = sys.argv[1]
if os.path.isfile(os.path.join(ck, "config.json")):
    sys.exit(print(f"reusing {ck}"))
t0 = time.perf_counter()
for d in (ck, ck + ".tmp"):
    shutil.rmtree(d, ignore_errors=True)
write_tiny_checkpoint(ck + ".tmp", text_overrides=k3_slice_overrides(int(sys.argv[2])))
os.rename(ck + ".tmp", ck)  # whole or absent: a part cut short never leaves a checkpoint the next part reuses
print(f"slice checkpoint {ck} written in {time.perf_counter() - t0:.1f} s")'

setup() {  # the FLA peer for bench_kda (no registry on the device: carried wheels only)
  if [ "$DRY" != 1 ] && ls "$CARRY"/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-deps --no-index --target "$FLA_SITE" "$CARRY"/wheels/*.whl 2>&1 | tail -n 3
  fi
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  PYTHONPATH="$FLA_SITE:$PYTHONPATH" "$PY" -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -n 1
  git log -1 --format='code: %h %s' 2>/dev/null || true
}

spec() {  # bench_spec at one batch: its own engines capture only that batch's graph buckets
  part "spec_b$1" "$2" "$3" "$PY" -u benchmarks/bench_spec.py --device "$DEVICE" --model k3-slice --slice-dir "$CK" \
    --methods ngram --workloads repetitive --batches "$1" --max-tokens 32 --json "$OUT/spec_b$1.json"
}

kda_ncu() {  # Nsight Compute over the three KDA prefill kernels at T = 16384, H = 96: details and per-kernel stalls
  ncu -k "regex:chunk_(prep|intra|state)" --launch-skip 3 --launch-count 3 --set full -o "$OUT/kda_ncu" -f \
    "$PY" scripts/kda_prefill_once.py 16384 || return $?
  local rc=0  # one source page holds the three kernels; ncu_summary summarises each
  ncu -i "$OUT/kda_ncu.ncu-rep" --page source --csv --print-source sass >/tmp/kda_ncu_sass.csv \
    && "$PY" scripts/ncu_summary.py /tmp/kda_ncu_sass.csv || rc=$?
  ncu -i "$OUT/kda_ncu.ncu-rep" --page details || rc=$?
  return $rc
}

run_part() {
  case $1 in
    slice) part slice 120 300 "$PY" -c "$SLICE_PY" "$CK" "$SLICE_WIDTH" ;;
    spec_b1) spec 1 130 230 ;;
    spec_b8) spec 8 100 230 ;;
    spec_b32) spec 32 130 230 ;;
    e2e) part e2e 200 80 "$PY" -u benchmarks/bench_e2e.py --batch 1 8 32 --steps 8 --checkpoint "$CK" ;;
    e2e_async) part e2e_async 200 80 "$PY" -u benchmarks/bench_e2e.py --batch 1 8 32 --steps 8 --checkpoint "$CK" \
      --async-scheduling ;;
    e2e_prefill) part e2e_prefill 200 60 "$PY" -u benchmarks/bench_e2e.py --prefill --rounds 1 --profile \
      --copies --checkpoint "$CK" ;;
    e2e_prefill_async) part e2e_prefill_async 150 0 "$PY" -u benchmarks/bench_e2e.py --prefill --rounds 2 \
      --async-scheduling --checkpoint "$CK" ;;
    conv) part conv 90 0 "${PEER[@]}" -u benchmarks/bench_kda.py --conv ;;
    moe32) part moe32 120 0 "$PY" -u benchmarks/bench_moe.py --experts 32 --tokens 8192 2048 --grouped --no-peer \
      --no-sass ;;
    kda_error) part kda_error 90 0 "$PY" -u scripts/kda_prefill_error.py ;;
    moe_prefill) part moe_prefill 150 0 "$PY" -u benchmarks/bench_moe.py --tokens 512 2048 --no-peer --no-sass ;;
    moe_tiles) part moe_tiles 150 0 "$PY" -u benchmarks/bench_moe.py --tokens 1024 2048 --no-peer --no-sass \
      --prefill-sweep --prefill-filter "tile_rows256" --out "$OUT" ;;
    cuda_s15) part cuda_s15 200 0 "$PY" -m pytest -v -p no:cacheprovider -m cuda --durations=10 \
      tests/kernels/triton/test_moe_grouped.py tests/kernels/triton/test_triton_kda.py \
      -k "grouped or short_conv or strided or (prefill and not fused)" ;;
    cuda_s16) part cuda_s16 240 0 env ROCM_K3_TEST_SLICE="$CK" "$PY" -m pytest -v -p no:cacheprovider -m cuda \
      --durations=10 tests/kernels/triton/test_moe_grouped.py tests/kernels/triton/test_triton_kda.py \
      tests/kernels/triton/test_triton_ops.py tests/kernels/triton/test_triton_model.py \
      -k "grouped or dequant or short_conv or kda_prefill or norms or ws_gemm_graph or (fused_moe_k3 and T2048) or k3_slice_bf16" ;;
    cuda_logits) part cuda_logits 200 0 env ROCM_K3_TEST_SLICE="$CK" "$PY" -m pytest -v -p no:cacheprovider -m cuda \
      --durations=10 tests/kernels/triton/test_triton_model.py -k bf16_triton_logits ;;
    op_errors) part op_errors 150 0 "$PY" -u scripts/bf16_op_errors.py "$CK" --force-routing ;;
    kda_ncu) export -f kda_ncu; export OUT PY; part kda_ncu 150 0 bash -c kda_ncu ;;
    kda_prof) part kda_prof 240 0 "${PEER[@]}" -u benchmarks/bench_kda.py --profile-only ;;
    kda_prep) part kda_prep 200 0 "${PEER[@]}" -u benchmarks/bench_kda.py --prep-compare --json "$OUT/kda_prep.json" ;;
    cuda_prep) part cuda_prep 200 0 "$PY" -m pytest -v -p no:cacheprovider -m cuda --durations=10 \
      tests/kernels/triton/test_triton_kda.py -k "kda_prefill_k3 and (products or solve-in-walk)" ;;
    cuda_kda) part cuda_kda 200 0 "$PY" -m pytest -v -p no:cacheprovider -m cuda --durations=10 \
      tests/kernels/triton/test_triton_kda.py tests/kernels/triton/test_triton_model.py tests/engine/test_engine_cuda.py \
      -k "(prefill and not unsplit) or tiny or geometry or prefix_caching" ;;
    cuda_lean) part cuda_lean 120 0 "$PY" -m pytest -v -p no:cacheprovider -m cuda --durations=10 \
      tests/kernels/triton/test_triton_kda.py -k "kda_prefill_k3 and (lean or norms)" ;;
    cuda_engine) part cuda_engine 120 0 "$PY" -m pytest -v -p no:cacheprovider -m cuda --durations=10 \
      tests/engine/test_engine_cuda.py tests/kernels/triton/test_triton_model.py -k "prefix_caching or geometry or bf16_triton_logits" ;;
    kda_saving) part kda_saving 90 0 "${PEER[@]}" -u benchmarks/bench_kda.py --prep-compare --saving-only \
      --json "$OUT/kda_saving.json" ;;
    kda_phase) part kda_phase 150 0 "${PEER[@]}" -u benchmarks/bench_kda.py --phase-compare --json "$OUT/kda_phase.json" ;;
    cuda_new) part cuda_new 300 0 "$PY" -m pytest -v -p no:cacheprovider -m cuda --continue-on-collection-errors \
      --durations=10 tests/worker/test_stage_graphs.py tests/engine/test_async_scheduling_cuda.py \
      tests/worker/test_cuda_graph.py tests/worker/test_verify_graphs.py tests/parallel/test_expert_dispatch_graph.py \
      tests/kernels/triton/test_triton_kda.py -k "not gfx and (prefill or graph or slice or stage or async or static or speculation)" ;;
    kda) part kda 150 0 "${PEER[@]}" -u benchmarks/bench_kda.py --prefill-only --json "$OUT/kda.json" ;;
    cuda_tier) part cuda_tier 600 0 "$PY" -m pytest -v -p no:cacheprovider -m cuda --continue-on-collection-errors \
      --durations=20 --junitxml="$OUT/cuda_tier.xml" tests/parallel/test_expert_dispatch_graph.py \
      tests/model/test_mla_gate_fusion.py tests/kernels/triton/test_triton_kda.py \
      tests/kernels/triton/test_triton_mla_prefill.py tests/worker tests/engine/test_engine_cuda.py ;;
    *) echo "unknown part $1 (slice spec_b1 spec_b8 spec_b32 e2e e2e_async e2e_prefill e2e_prefill_async kda kda_ncu kda_prof kda_phase kda_prep kda_saving conv kda_error moe32 moe_prefill moe_tiles cuda_logits op_errors cuda_new cuda_s15 cuda_s16 cuda_prep cuda_kda cuda_lean cuda_engine cuda_tier)" >&2; return 2 ;;
  esac
}

setup >"$OUT/setup.txt" 2>&1
cat "$OUT/setup.txt"
parts=("$@")
((${#parts[@]})) || parts=(slice spec_b1 spec_b8 spec_b32 e2e kda cuda_tier)
for p in "${parts[@]}"; do
  run_part "$p" || exit $?
done
echo "== done at +$((SECONDS - start)) s"
# the device returns at most 8 files: past 7, everything travels in one archive
if [ "$DRY" != 1 ] && (($(find "$OUT" -maxdepth 1 -type f | wc -l) > 7)); then
  (cd "$OUT" && tar czf /tmp/h200_results.tgz --exclude results.tgz . && find . -maxdepth 1 -type f -delete \
    && mv /tmp/h200_results.tgz results.tgz)
fi
