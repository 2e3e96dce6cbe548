"""The MoE expert GEMMs on Hopper (sm_90) as a warp-specialised Gluon kernel: TMA producer, decode + wgmma consumer.

Same work as :func:`.kernels.moe_gemm_kernel` on the same ``triton`` layout (:mod:`.layout`), item order (static:
program p takes items p, p + programs, ...), decode bits (:data:`.decode.ASM_FOLD`) and epilogue math
(:func:`.kernels.gate_up_activation`); only the schedule differs. An item is one expert block of ``BM`` (16, 32, 64
or 128) rows, the MMA's N side, times one 128-row N tile (or, with ``WsConfig.tile_rows`` 256, two: four 64-row
groups and accumulators, the block's activation rows read once per 256 weight rows; :func:`wide_config`, measured
at K3's prefill and not picked by default, benchmarks/RESULTS.md session 16) and, for w2, one of ``SPLIT`` K parts.
Per CTA:

- producer partition (``BM // 16`` warps, at most 4, ``producer_regs`` registers after ``setmaxnreg``): per 128-K step
  it waits for a free slot of a ``STAGES``-deep ring (``empty`` mbarrier); warp 0 TMA-loads the codes (2 or 4 64-row
  groups x two 64-K units, each unit one 2 KB row of the int64 view ``[E * groups, 2 K groups, 256]``: with 16-byte TMA
  rows the same kernel reached 57 % of HBM, with 2 KB rows 83 %) and scales (``[groups, 256 B]``), and every producer
  thread cp.async-loads its share of the block's activation rows (``[BM, 128]`` bf16: gathered token rows of x for
  w13, the block's own rows of the intermediate for w2); the slot's ``full`` mbarrier completes when the TMA bytes
  and every producer thread's copies have landed.
- consumer partition (4 warps, one warpgroup): per step it waits for ``full``, and for each 64-row group loads its
  own 16-byte chunks from shared memory and decodes them straight into the register A operand of ``wgmma``
  (``assert_trivial``: the layouts only relabel registers), then issues that group's asynchronous ``m64nBMk16``
  chain; one group's chain runs while the other group is decoded, and the slot is freed once both chains of the
  step are done. The epilogue: w13 ``act(gate, up)`` (under A8W4 rounded through MXFP8 per 32 outputs of a row,
  in registers) -> ``inter`` (bf16), w2 ``topk_weight * acc`` -> ``y`` (fp32, one slice per K part).

Programmatic dependent launch (``WsConfig.pdl``, on by default): w13 waits for the align on the device; w2 starts
while w13's last items run, prefetches its first weights and waits before its first activation rows; w2's
consumers let the top-k reduce start, which waits for w2. Residency per block size is :func:`default_config`
(16 rows: 3 CTAs per SM at 80 registers, 40 for the producer; ptxas serialised the wgmma chains at a cap of 64).
Measured against ``moe_gemm_kernel`` and the triton_kernels peer on the H200 in ``benchmarks/RESULTS.md``.
:func:`supported` says when it applies; :mod:`.fused` falls back to ``moe_gemm_kernel`` otherwise. Written for
Triton 3.6 (the H200 image) and later: the two Gluon names that changed are resolved at import.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from rocm_k3.triton_kernels.moe import decode
from rocm_k3.triton_kernels.moe.kernels import gate_up_activation
from rocm_k3.triton_kernels.moe.mx import mxfp8_value

SHARED_PER_SM = 227 * 1024  # bytes of shared memory the CTAs of one SM may use (sm_90)
ASM_FOLD = gl.constexpr(decode.ASM_FOLD.value)
GROUP_BYTES = gl.constexpr(4096 + 256)  # codes + scales of one 128-K step of one 64-row group
TILE_ROWS = (128, 256)  # weight rows of one item (2 or 4 row groups) the kernel takes
_VERSION = re.match(r"(\d+)\.(\d+)", triton.__version__)
TRITON_VERSION = (int(_VERSION.group(1)), int(_VERSION.group(2))) if _VERSION else (0, 0)  # checked by supported()
# Triton 3.6 names the shared-memory view cast ``_reinterpret`` and the loads ``async_copy_global_to_shared``
NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
BLOCK_SIZES = (16, 32, 64, 128)  # expert block rows (the MMA's N side) the kernel takes


def producer_warps(block_m: int) -> int:
    """Producer warps of a ``block_m``-row block: one per 16 activation rows, at most 4 (a CTA stays within 8
    warps; at 128 rows each producer thread copies 16 chunks of 16 B per step)."""
    return block_m // 16 if block_m <= 64 else 4


def codes_smem_layout() -> gl.NVMMASharedLayout:
    """The codes' TMA box ``[groups, 2 units, 256]`` int64, unswizzled (each thread then reads its own 16 B)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=64, rank=3)


def scales_smem_layout() -> gl.NVMMASharedLayout:
    """The scales' TMA box ``[groups, 1 K group, 256 B]``, unswizzled."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)


@gluon.jit
def _view(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    if NEW_REINTERPRET:
        return smem.reinterpret(dtype, shape, layout)
    else:
        return smem._reinterpret(dtype, shape, layout)


@gluon.jit
def _gdc_wait():
    """Programmatic dependent launch: wait until the previous kernel of the stream has completed and its memory is
    visible (a no-op when the kernel was not launched with ``launch_pdl``)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    """Let the next kernel of the stream (launched with ``launch_pdl``) start on the SMs this grid leaves free."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _item(item, n_tiles, block_expert_ptr, start_ptr, count_ptr, sorted_ptr, BM: gl.constexpr, SPLIT: gl.constexpr,
          RL: gl.constexpr):
    """(tile, K part, expert, padded rows [BM] in layout RL, their mask, their pair ids) of one work item; a
    block's items are adjacent (its activation rows stay in L2), K parts of one tile too."""
    part = item % SPLIT
    tile = (item // SPLIT) % n_tiles
    blk = item // (SPLIT * n_tiles)
    expert = gl.load(block_expert_ptr + blk)
    row_end = gl.load(start_ptr + expert) + gl.load(count_ptr + expert)
    rows = blk * BM + gl.arange(0, BM, layout=RL)
    rmask = rows < row_end
    pair = gl.load(sorted_ptr + rows, mask=rmask, other=0)
    return tile, part, expert, rows, rmask, pair


@gluon.jit
def _load_weights(codes_desc, scales_desc, codes_s, scales_s, bar, rg, ks, G: gl.constexpr):
    """One step's codes and scales of G row groups (TMA) into a ring slot, completing on ``bar`` (which expects
    their bytes)."""
    mbarrier.expect(bar, G * GROUP_BYTES)
    tma_load(codes_desc, [rg, 2 * ks, 0], bar, codes_s)
    tma_load(scales_desc, [rg, ks, 0], bar, scales_s)


@gluon.jit
def _producer(codes_desc, scales_desc, a_ptr, sorted_ptr, block_expert_ptr, start_ptr, count_ptr, nblk_ptr,
              codes_s, scales_s, act_s, full, empty, n_tiles, steps, top_k, stride_a, row_groups,
              STAGE: gl.constexpr, BM: gl.constexpr, SPLIT: gl.constexpr, NUM_STAGES: gl.constexpr,
              PW: gl.constexpr, PDL: gl.constexpr, G: gl.constexpr):
    AL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [PW, 1], [1, 0])  # [BM, 128] bf16, 8 x 16 B per thread
    kk = gl.arange(0, 128, layout=gl.SliceLayout(0, AL))
    pre = 0  # steps of the first item whose weights were loaded before waiting on the previous kernel
    if PDL:
        if STAGE == 1:
            _gdc_wait()  # the routing comes from the align kernel just before
            _gdc_launch_dependents()  # (after the wait: the w2 kernel reads the routing without waiting)
        else:  # the weights do not depend on the w13 kernel: the first slots fill while its last items finish
            first = gl.program_id(0)
            if first < gl.load(nblk_ptr) * n_tiles * SPLIT:
                tile0 = (first // SPLIT) % n_tiles
                rg0 = gl.load(block_expert_ptr + first // (SPLIT * n_tiles)) * row_groups + G * tile0
                k0 = (first % SPLIT) * steps
                pre = gl.minimum(steps, NUM_STAGES)
                for ks in range(pre):
                    _load_weights(codes_desc, scales_desc, codes_s.index(ks), scales_s.index(ks), full.index(ks),
                                  rg0, k0 + ks, G)
            _gdc_wait()  # the intermediate is the w13 kernel's output
    n_items = gl.load(nblk_ptr) * n_tiles * SPLIT
    cnt = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        tile, part, expert, rows, rmask, pair = _item(item, n_tiles, block_expert_ptr, start_ptr, count_ptr,
                                                      sorted_ptr, BM, SPLIT, gl.SliceLayout(1, AL))
        k0 = part * steps  # the item's first 128-K step
        if STAGE == 1:
            a_rows = a_ptr + ((pair // top_k).to(gl.int64) * stride_a)[:, None] + (k0 * 128 + kk)[None, :]  # x
        else:
            a_rows = a_ptr + (rows.to(gl.int64) * stride_a)[:, None] + (k0 * 128 + kk)[None, :]  # inter rows
        rg = expert * row_groups + G * tile
        for ks in range(steps):
            s = cnt % NUM_STAGES
            mbarrier.wait(empty.index(s), ((cnt // NUM_STAGES) & 1) ^ 1)  # the ring's first pass waits on nothing
            cp_async_load(act_s.index(s), a_rows + ks * 128, mask=rmask[:, None])
            # each thread arrives once its copies have landed (full counts 32 * PW of these and the expect's)
            async_copy.mbarrier_arrive(full.index(s), increment_count=False)
            if cnt >= pre:
                _load_weights(codes_desc, scales_desc, codes_s.index(s), scales_s.index(s), full.index(s), rg,
                              k0 + ks, G)
            cnt += 1


@gluon.jit
def _decode(codes_s, scales_s, L3: gl.constexpr, L7: gl.constexpr, A: gl.constexpr):
    """One 64-row group x 128 K: codes [256 chunks = 128 unit + 32 w + 4 g + q, 16 B] and scale words [4 w, 8 g,
    2 unit] in shared memory -> the bf16 wgmma A operand [64, 128] (row 16 w + 8 h + g, k as in :mod:`.layout`)."""
    codes = codes_s.load(L3)  # thread (w, g, q) owns the chunks of units 0 and 1
    codes = gl.convert_layout(gl.reshape(codes, [2, 4, 8, 4, 2, 2, 4]), L7, assert_trivial=True)  # u w g q s1 s0 b
    S4: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(5, gl.SliceLayout(6, L7)))  # [u, w, g, s1]
    words = scales_s.permute((2, 0, 1)).load(gl.SliceLayout(3, S4))  # [u, w, g]: bytes (h, s1)
    sh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, S4)))) * 8
    pair = (words[:, :, :, None] >> sh[None, None, None, :]) & 0x00FF00FF  # scales of rows r | r + 8 per s1
    mult = pair * 128 + 0x3F003F00  # bf16x2 2^(s - 1) (FOLD)
    mult = mult[:, :, :, None, :, None, None] + gl.zeros([2, 4, 8, 4, 2, 2, 4], gl.int32, layout=L7)
    lo, hi = gl.inline_asm_elementwise(ASM_FOLD, "=r,=r,=r,=r,r,r,r,r,r", [codes, mult],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    v = gl.reshape(gl.join(lo, hi), [2, 4, 8, 4, 2, 2, 2, 2, 2])  # u w g q s1 s0 h e c
    v = gl.permute(v, [1, 6, 2, 0, 4, 5, 8, 3, 7])  # rows (w h g), k (u s1 s0 c q e)
    return gl.convert_layout(gl.reshape(v, [64, 128]), A, assert_trivial=True)


@gluon.jit
def _epilogue(acc0, acc1, pt, part, rows, rmask, pair, out_ptr, topw_ptr, n_out, stride_out, stride_split, beta,
              linear_beta, STAGE: gl.constexpr, ACT: gl.constexpr, HAS_LINEAR_BETA: gl.constexpr,
              FAST_ACT: gl.constexpr, OUT_MX: gl.constexpr, EMAX: gl.constexpr, BIAS: gl.constexpr,
              FP8_MAX: gl.constexpr, MMA: gl.constexpr):
    """Stores one pair of row groups' accumulators ``[64, BM]``: 128-row tile ``pt`` of the weights (w13: gate
    and up rows of outputs 64 pt .. 64 pt + 63; w2: outputs 128 pt .. 128 pt + 127)."""
    r64 = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    if STAGE == 1:  # [64 outputs, BM rows] -> inter[row, 64 tile + r]
        h = gate_up_activation(acc0, acc1, beta, linear_beta, ACT, HAS_LINEAR_BETA, FAST_ACT)
        if OUT_MX:  # A8W4: h rounded through MXFP8 per 32 outputs of a row (the reference's rule), in place
            lo = (r64 < 32)[:, None]  # the tile's two MX blocks per row: outputs 0-31 and 32-63
            a = gl.abs(h)
            amax = gl.where(lo, gl.max(gl.where(lo, a, 0.0), axis=0)[None, :],
                            gl.max(gl.where(lo, 0.0, a), axis=0)[None, :])
            h = mxfp8_value(h, amax, EMAX, BIAS, FP8_MAX)
        n = pt * 64 + r64
        optr = out_ptr + rows.to(gl.int64)[None, :] * stride_out + n[:, None]
        gl.store(optr, h.to(out_ptr.dtype.element_ty), mask=rmask[None, :] & (n < n_out)[:, None])
    else:  # y[part, pair, 128 tile + r] = topk_weight[pair] * acc (the K part's share; the reduce sums them)
        rw = gl.load(topw_ptr + pair, mask=rmask, other=0.0)[None, :]
        optr = out_ptr + part.to(gl.int64) * stride_split + pair.to(gl.int64)[None, :] * stride_out
        n = pt * 128 + r64
        gl.store(optr + n[:, None], acc0 * rw, mask=rmask[None, :] & (n < n_out)[:, None])
        gl.store(optr + (n + 64)[:, None], acc1 * rw, mask=rmask[None, :] & (n + 64 < n_out)[:, None])


@gluon.jit
def _consumer(out_ptr, topw_ptr, sorted_ptr, block_expert_ptr, start_ptr, count_ptr, nblk_ptr, codes_s, scales_s,
              act_s, full, empty, n_tiles, steps, n_out, stride_out, stride_split, beta, linear_beta,
              STAGE: gl.constexpr, ACT: gl.constexpr, HAS_LINEAR_BETA: gl.constexpr, FAST_ACT: gl.constexpr,
              BM: gl.constexpr, SPLIT: gl.constexpr, NUM_STAGES: gl.constexpr, PDL: gl.constexpr,
              OUT_MX: gl.constexpr, EMAX: gl.constexpr, BIAS: gl.constexpr, FP8_MAX: gl.constexpr,
              G: gl.constexpr):
    L3: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [4, 1], [1, 0])
    L7: gl.constexpr = gl.BlockedLayout([2, 1, 1, 1, 2, 2, 4], [1, 1, 8, 4, 1, 1, 1], [1, 4, 1, 1, 1, 1, 1],
                                        [6, 5, 4, 3, 2, 1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    if PDL:
        if STAGE == 1:
            _gdc_wait()  # the routing comes from the align kernel just before
        else:
            _gdc_launch_dependents()  # the top-k reduce may start; it waits for this grid on the device
    n_items = gl.load(nblk_ptr) * n_tiles * SPLIT
    cnt = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        acc0 = gl.zeros([64, BM], gl.float32, layout=MMA)  # the tile's first row group (w13: gate rows)
        acc1 = gl.zeros([64, BM], gl.float32, layout=MMA)  # the second (w13: the matching up rows)
        if G == 4:  # the next 128-row tile's two groups
            acc2 = gl.zeros([64, BM], gl.float32, layout=MMA)
            acc3 = gl.zeros([64, BM], gl.float32, layout=MMA)
        prev = 0
        for ks in range(steps):
            s = cnt % NUM_STAGES
            mbarrier.wait(full.index(s), (cnt // NUM_STAGES) & 1)
            b = act_s.index(s).permute((1, 0))  # [128, BM]
            cs = _view(codes_s.index(s), gl.uint8, [G, 256, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
            ss = _view(scales_s.index(s), gl.int32, [G, 4, 8, 2], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
            if G == 2:
                acc0 = warpgroup_mma(_decode(cs.index(0), ss.index(0), L3, L7, A), b, acc0, is_async=True)
                acc0, acc1 = warpgroup_mma_wait(1, deps=[acc0, acc1])  # the previous step's second chain is done
                mbarrier.arrive(empty.index(prev), pred=ks > 0)
                acc1 = warpgroup_mma(_decode(cs.index(1), ss.index(1), L3, L7, A), b, acc1, is_async=True)
                acc0, acc1 = warpgroup_mma_wait(1, deps=[acc0, acc1])
            else:  # one chain in flight while the next group is decoded, as above, over four groups
                acc0 = warpgroup_mma(_decode(cs.index(0), ss.index(0), L3, L7, A), b, acc0, is_async=True)
                acc0, acc1, acc2, acc3 = warpgroup_mma_wait(1, deps=[acc0, acc1, acc2, acc3])
                mbarrier.arrive(empty.index(prev), pred=ks > 0)  # the previous step's last chain is done
                acc1 = warpgroup_mma(_decode(cs.index(1), ss.index(1), L3, L7, A), b, acc1, is_async=True)
                acc0, acc1, acc2, acc3 = warpgroup_mma_wait(1, deps=[acc0, acc1, acc2, acc3])
                acc2 = warpgroup_mma(_decode(cs.index(2), ss.index(2), L3, L7, A), b, acc2, is_async=True)
                acc0, acc1, acc2, acc3 = warpgroup_mma_wait(1, deps=[acc0, acc1, acc2, acc3])
                acc3 = warpgroup_mma(_decode(cs.index(3), ss.index(3), L3, L7, A), b, acc3, is_async=True)
                acc0, acc1, acc2, acc3 = warpgroup_mma_wait(1, deps=[acc0, acc1, acc2, acc3])
            prev = s
            cnt += 1
        if G == 2:
            acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
        else:
            acc0, acc1, acc2, acc3 = warpgroup_mma_wait(0, deps=[acc0, acc1, acc2, acc3])
        mbarrier.arrive(empty.index(prev))
        tile, part, expert, rows, rmask, pair = _item(item, n_tiles, block_expert_ptr, start_ptr, count_ptr,
                                                      sorted_ptr, BM, SPLIT, gl.SliceLayout(0, MMA))
        _epilogue(acc0, acc1, tile * (G // 2), part, rows, rmask, pair, out_ptr, topw_ptr, n_out, stride_out,
                  stride_split, beta, linear_beta, STAGE, ACT, HAS_LINEAR_BETA, FAST_ACT, OUT_MX, EMAX, BIAS,
                  FP8_MAX, MMA)
        if G == 4:
            _epilogue(acc2, acc3, tile * 2 + 1, part, rows, rmask, pair, out_ptr, topw_ptr, n_out, stride_out,
                      stride_split, beta, linear_beta, STAGE, ACT, HAS_LINEAR_BETA, FAST_ACT, OUT_MX, EMAX, BIAS,
                      FP8_MAX, MMA)


@gluon.jit
def moe_gemm_ws_kernel(codes_desc, scales_desc, a_ptr, out_ptr, topw_ptr, sorted_ptr, block_expert_ptr, start_ptr,
                       count_ptr, nblk_ptr, n_tiles, steps, n_out, top_k, stride_a, stride_out, stride_split,
                       row_groups, beta, linear_beta, STAGE: gl.constexpr, ACT: gl.constexpr,
                       HAS_LINEAR_BETA: gl.constexpr, FAST_ACT: gl.constexpr, BM: gl.constexpr, SPLIT: gl.constexpr,
                       NUM_STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr, PDL: gl.constexpr,
                       OUT_MX: gl.constexpr, EMAX: gl.constexpr, BIAS: gl.constexpr, FP8_MAX: gl.constexpr,
                       GROUPS: gl.constexpr = 2):
    """STAGE 1: ``out = inter [P, n_out] = act(W13_e x_t)``; STAGE 2: ``out = y [T * top_k, n_out] (fp32) =
    topk_weight * W2_e inter``, or with SPLIT > 1 (w2 only) ``y [SPLIT, T * top_k, n_out]`` the partial sums of
    SPLIT equal K parts, over the used (BM-row block, 64 GROUPS-row tile, K part) items. The arguments are those of
    :func:`.kernels.moe_gemm_kernel` (K = 128 * steps * SPLIT), the weights as TMA descriptors over the int64
    codes view ``[E * groups, 2 * steps, 256]`` and the scales view ``[E * groups, steps, 256]`` (uint8), boxes of
    GROUPS row groups; n_tiles counts GROUPS-group tiles. BM: 16, 32, 64 or 128 (:func:`producer_warps`); PDL:
    launched with ``launch_pdl`` (see :class:`WsConfig`); GROUPS: 64-row weight groups per item, 2 or 4 (4: four
    accumulators, the block's activation rows read once per 256 weight rows instead of per 128)."""
    PW: gl.constexpr = BM // 16 if BM <= 64 else 4  # producer warps (producer_warps)
    codes_s = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, GROUPS, 2, 256], codes_desc.layout)
    scales_s = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, GROUPS, 1, 256], scales_desc.layout)
    act_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BM, 128],
                                      gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(full.index(i), count=32 * PW + 1)  # every producer thread's copies and the TMA bytes' expect
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (out_ptr, topw_ptr, sorted_ptr, block_expert_ptr, start_ptr, count_ptr, nblk_ptr, codes_s,
                     scales_s, act_s, full, empty, n_tiles, steps, n_out, stride_out, stride_split, beta,
                     linear_beta, STAGE, ACT, HAS_LINEAR_BETA, FAST_ACT, BM, SPLIT, NUM_STAGES, PDL, OUT_MX, EMAX,
                     BIAS, FP8_MAX, GROUPS)),
        (_producer, (codes_desc, scales_desc, a_ptr, sorted_ptr, block_expert_ptr, start_ptr, count_ptr, nblk_ptr,
                     codes_s, scales_s, act_s, full, empty, n_tiles, steps, top_k, stride_a, row_groups, STAGE, BM,
                     SPLIT, NUM_STAGES, PW, PDL, GROUPS)),
    ], [PW], [PRODUCER_REGS])


@dataclasses.dataclass(frozen=True)
class WsConfig:
    """Tiles and residency of :func:`moe_gemm_ws_kernel`.

    block_m: rows of an expert block, the MMA's N side (16, 32, 64 or 128; :func:`producer_warps`).
    stages: slots of the shared-memory ring (codes, scales and activation rows of one 128-K step each).
    ctas_per_sm: resident CTAs per SM the grid is sized for (shared memory and registers must allow it).
    max_registers: the kernel's register cap per thread (ptxas), which with 8 warps per CTA sets the CTA's share.
    producer_regs: registers per producer thread after ``setmaxnreg`` (the consumer warpgroup gets the rest).
    pdl: launched as a programmatic dependent launch: w13 waits for the align on the device instead of at the
        launch, and w2 loads its first weights while the w13 kernel's last items finish; ``fused_moe_with`` then
        launches the align and the top-k reduce the same way (False: every launch waits for the previous one).
    w2_split: K parts of the w2 GEMM (1-4; the top-k reduce sums them), None: :func:`w2_parts` picks them from the
        expected item count (more, shorter items where few items would leave programs idle at the end).
    tile_rows: weight rows of one item, 128 (two 64-row groups, two accumulators) or 256 (four: half the activation
        re-reads per weight byte, twice the accumulator registers; not at 128-row blocks, whose four accumulators
        alone would take 256 registers per consumer thread).
    """

    block_m: int = 16
    stages: int = 4
    ctas_per_sm: int = 3
    max_registers: int = 80
    producer_regs: int = 24
    pdl: bool = True
    w2_split: int | None = None
    tile_rows: int = 128

    def __post_init__(self) -> None:
        for name in ("block_m", "stages", "ctas_per_sm", "max_registers", "producer_regs", "tile_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"WsConfig.{name} must be an int, got {value!r}")
        if self.block_m not in BLOCK_SIZES:
            raise ValueError(f"WsConfig.block_m must be 16, 32, 64 or 128, got {self.block_m}")
        if self.tile_rows not in TILE_ROWS:
            raise ValueError(f"WsConfig.tile_rows must be 128 or 256, got {self.tile_rows}")
        if self.groups * self.block_m // 2 >= 256:  # fp32 accumulators [64, BM] per group over 128 consumer threads
            raise ValueError(f"WsConfig: tile_rows {self.tile_rows} at {self.block_m}-row blocks needs "
                             f"{self.groups * self.block_m // 2} accumulator registers per consumer thread (at most "
                             "255: ptxas spills them and serialises the wgmma); use 128-row tiles or smaller blocks")
        if not 2 <= self.stages <= 8:
            raise ValueError(f"WsConfig.stages must be in [2, 8], got {self.stages}")
        if not 1 <= self.ctas_per_sm <= 4:
            raise ValueError(f"WsConfig.ctas_per_sm must be in [1, 4], got {self.ctas_per_sm}")
        for name in ("max_registers", "producer_regs"):  # setmaxnreg takes multiples of 8 in [24, 256]
            value = getattr(self, name)
            if not 24 <= value <= 248 or value % 8:
                raise ValueError(f"WsConfig.{name} must be a multiple of 8 in [24, 248], got {value}")
        if self.max_registers * 256 * self.ctas_per_sm > 65536:  # at most 8 warps per CTA (2 warpgroups)
            raise ValueError(f"WsConfig: {self.ctas_per_sm} CTAs of 256 threads at {self.max_registers} registers "
                             "exceed the SM's 65536")
        if self.shared_bytes() * self.ctas_per_sm > SHARED_PER_SM:
            raise ValueError(f"WsConfig: {self.ctas_per_sm} CTAs of {self.shared_bytes()} B of shared memory exceed "
                             f"the SM's {SHARED_PER_SM}")
        if not isinstance(self.pdl, bool):
            raise TypeError(f"WsConfig.pdl must be a bool, got {self.pdl!r}")
        if self.w2_split is not None and (isinstance(self.w2_split, bool) or not isinstance(self.w2_split, int)
                                          or not 1 <= self.w2_split <= 4):
            raise ValueError(f"WsConfig.w2_split must be None or an int in [1, 4], got {self.w2_split!r}")

    def shared_bytes(self) -> int:
        """Shared memory of one CTA: the ring (codes, scales, activation rows) and its barriers, the A8W4
        epilogue's cross-warp maxima (16 B per row), plus 1 KB the hardware reserves per CTA."""
        step = self.groups * GROUP_BYTES.value + self.block_m * 256 + 16
        return self.stages * step + self.block_m * 16 + 1024

    @property
    def groups(self) -> int:
        """64-row weight groups per item."""
        return self.tile_rows // 64


def default_config(block_m: int) -> WsConfig:
    """The measured defaults per block size (benchmarks/RESULTS.md, sessions 7 to 9; 128-row weight tiles: the
    256-row ones of :func:`wide_config` were level or slower at K3's T = 2048 / 8192, session 16)."""
    if block_m == 16:
        return WsConfig(16, 4, 3, 80, 40)
    if block_m == 32:
        return WsConfig(32, 4, 3, 80, 32)
    if block_m == 64:
        return WsConfig(64, 4, 2, 128, 40)
    if block_m == 128:  # two [64, 128] fp32 accumulators (128 registers per consumer thread): one CTA per SM
        return WsConfig(128, 4, 1, 248, 40)
    raise ValueError(f"the warp-specialised GEMM takes 16-, 32-, 64- or 128-row blocks, got {block_m}")


def wide_config(block_m: int) -> WsConfig:
    """256-row weight tiles at the prefill block sizes (the block's activation rows read once per 256 weight rows):
    at 32-row blocks 2 CTAs per SM (the four [64, 32] accumulators fit 128 registers per thread), at 64 rows one
    CTA (four [64, 64] accumulators: at 128 registers ptxas serialises the wgmma chains) with a 6-deep ring."""
    if block_m == 32:
        return WsConfig(32, 4, 2, 128, 32, tile_rows=256)
    if block_m == 64:
        return WsConfig(64, 6, 1, 248, 40, tile_rows=256)
    raise ValueError(f"256-row weight tiles are configured for 32- or 64-row blocks, got {block_m}")


@dataclasses.dataclass(frozen=True)
class Descriptors:
    """TMA descriptors of one prepared MXFP4 matrix (``layout.TritonExperts`` w13 or w2) and its sizes."""

    codes: TensorDescriptor
    scales: TensorDescriptor
    row_groups: int  # 64-row groups per expert
    steps: int  # 128-K groups
    groups: int = 2  # row groups per TMA box (WsConfig.groups)


def descriptors(codes: torch.Tensor, scales: torch.Tensor, groups: int = 2) -> Descriptors:
    """Descriptors of codes uint8 [E, G, KG, 2, 128, 16] and scales uint8 [E, G, KG, 32, 8] (contiguous), boxes of
    ``groups`` row groups (``WsConfig.groups``)."""
    if not (codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError("the prepared MXFP4 codes and scales must be contiguous for their TMA descriptors")
    e, g, kg = codes.shape[:3]
    c = codes.view(torch.int64).view(e * g, kg * 2, 256)  # a 64-K unit's 128 chunks of 16 B as one 2 KB row
    s = scales.view(e * g, kg, 256)
    return Descriptors(TensorDescriptor(c, list(c.shape), list(c.stride()), [groups, 2, 256], codes_smem_layout()),
                       TensorDescriptor(s, list(s.shape), list(s.stride()), [groups, 1, 256], scales_smem_layout()),
                       g, kg, groups)


def supported(x: torch.Tensor, fold: bool, block_m: int, split_k: int, k: int) -> tuple[bool, str]:
    """Whether one GEMM of the op can run here on :func:`moe_gemm_ws_kernel` (else ``moe_gemm_kernel``); ``x``:
    its activation operand (x for w13, the intermediate for w2), ``k`` its reduction length."""
    if x.device.type != "cuda" or torch.version.hip is not None:
        return False, "needs an NVIDIA GPU"
    if TRITON_VERSION < (3, 6):
        return False, f"needs Triton >= 3.6 (the Gluon API it is written for), got {triton.__version__}"
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return False, "needs sm_90 (wgmma and setmaxnreg)"
    if x.dtype != torch.bfloat16:
        return False, f"needs bf16 activations, got {x.dtype}"
    if not fold:
        return False, "needs every E8M0 scale byte <= 128 (the one-multiply decode)"
    if block_m not in BLOCK_SIZES or split_k != 1:
        return False, f"needs 16-, 32-, 64- or 128-row blocks and no K split, got block_m={block_m} split_k={split_k}"
    if k % 128:
        return False, f"needs K a multiple of 128, got {k}"
    if x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16 or x.stride(-1) != 1:
        return False, "needs 16-byte aligned activation rows (cp.async of 16 bytes)"
    return True, "supported"


def w2_parts(cfg: WsConfig, items: int, programs: int, steps: int) -> int:
    """K parts of the w2 GEMM: ``cfg.w2_split``, or for an expected ``items`` (blocks x 128-row tiles) on
    ``programs`` CTAs the fewest parts (of ``steps`` 128-K steps, evenly) whose last round of items leaves at most
    10 % of the programs' work idle (else the least idle), 1 past 8 rounds."""
    if cfg.w2_split is not None:
        if steps % cfg.w2_split:
            raise ValueError(f"WsConfig.w2_split {cfg.w2_split} does not divide the w2 GEMM's {steps} K steps")
        return cfg.w2_split
    if items >= 8 * programs:
        return 1
    def idle(parts: int) -> float:
        work = items * parts / programs  # rounds of items per program
        return 1 - work / -(-work // 1)
    options = [p for p in (1, 2, 3, 4) if steps % p == 0]
    return next((p for p in options if idle(p) <= 0.1), min(options, key=idle))


def launch(stage: int, desc: Descriptors, a: torch.Tensor, out: torch.Tensor, topw: torch.Tensor, routing,
           n_tiles: int, n_out: int, top_k: int, beta: float, linear_beta: float, act: int, has_linear_beta: bool,
           fast_act: bool, programs: int, cfg: WsConfig, split: int = 1,
           out_mx: tuple[int, int, float] | None = None) -> None:
    """One GEMM of the op (see :func:`moe_gemm_ws_kernel`); ``programs``: the grid (``cfg.ctas_per_sm`` per SM at
    most); ``cfg.block_m`` must be the routing's; ``n_tiles``: items per block and K part (``cfg.tile_rows``-row
    tiles); ``desc``: boxes of ``cfg.groups`` row groups; ``split``: K parts (w2 only, dividing its steps; ``out`` then
    [split, pairs, n_out]); ``out_mx``: (EMAX, BIAS, FP8_MAX) of the FP8 format the w13 output is rounded
    through (A8W4), None for none."""
    if out_mx is not None and stage != 1:
        raise ValueError("the MXFP8 output rounding (A8W4) applies to the w13 GEMM only")
    emax, bias, fp8_max = out_mx or (8, 7, 448.0)  # unused without OUT_MX
    if desc.groups != cfg.groups:
        raise ValueError(f"descriptors of {desc.groups}-group boxes for WsConfig.tile_rows {cfg.tile_rows}")
    if cfg.block_m != routing.block_m:
        raise ValueError(f"WsConfig.block_m {cfg.block_m} differs from the routing's blocks of {routing.block_m}")
    if split != 1 and (stage != 2 or desc.steps % split or out.dim() != 3 or out.shape[0] != split):
        raise ValueError(f"a K split ({split}) needs the w2 GEMM, parts dividing its {desc.steps} steps and y "
                         f"[{split}, pairs, n_out], got stage {stage}, y {tuple(out.shape)}")
    moe_gemm_ws_kernel[(programs,)](
        desc.codes, desc.scales, a, out, topw, routing.sorted_pairs, routing.block_expert, routing.expert_start,
        routing.expert_count, routing.num_blocks, n_tiles, desc.steps // split, n_out, top_k, a.stride(0),
        out.stride(-2), out.stride(0) if out.dim() == 3 else 0, desc.row_groups, beta, linear_beta, STAGE=stage,
        ACT=act, HAS_LINEAR_BETA=has_linear_beta, FAST_ACT=fast_act, BM=cfg.block_m, SPLIT=split,
        NUM_STAGES=cfg.stages, PRODUCER_REGS=cfg.producer_regs, PDL=cfg.pdl, OUT_MX=out_mx is not None,
        EMAX=emax, BIAS=bias, FP8_MAX=fp8_max, GROUPS=cfg.groups, num_warps=4, maxnreg=cfg.max_registers,
        launch_pdl=cfg.pdl)
