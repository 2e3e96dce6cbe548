"""Triton kernels for rocm-k3 (the NVIDIA backend, portable to ROCm).

Subpackages and modules each expose ``KERNELS = {op_name: (fn, supports_fn)}``; :mod:`.backend` registers them
with the op registry. :mod:`.compile_check` cross-compiles a kernel for sm_90/gfx942/gfx950 without a GPU.
Nothing here imports triton at package import time.
"""
