#!/usr/bin/env bash
# Make Debian's lld-19 available for FlyDSL's compile-only link (see ../shared/PLATFORM.md).
# FlyDSL calls $ROCM_PATH/llvm/bin/ld.lld; rocm_k3.flydsl_kernels.toolchain finds /usr/lib/llvm-19/bin/ld.lld itself.
set -euo pipefail
if [ -x /usr/lib/llvm-19/bin/ld.lld ]; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "ensure_lld: lld-19 missing and cannot apt-get install it here; the compile tier will skip" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq lld-19 >/dev/null
