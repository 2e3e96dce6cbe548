"""Cross-compile every rocm-k3 Triton kernel for sm_90, gfx942 and gfx950 and print a JSON summary.

Run by ``tests/kernels/triton/test_triton_ops.py`` (compile tier) in a fresh interpreter *without* ``TRITON_INTERPRET``:
Triton decides at import time whether every ``@triton.jit`` (its own standard library included) is interpreted,
so the interpreter tier and real compilation cannot share one process. Output: one JSON object
``{"<kernel>/<target>": {"ok": bool, "error": str, "mnemonics": [...], "registers": int, "spills": int,
"scratch": int}}`` on stdout.
"""

from __future__ import annotations

import json
import sys

TARGETS = ("sm_90", "gfx942", "gfx950")


def _specs() -> dict:
    """kernel name -> (module, attribute, signature, constexprs, num_warps, num_stages[, divisible_by_16])."""
    from rocm_k3.triton_kernels.moe.kernels import GEMM_DIVISIBLE

    specs = {}
    for name, spec in _launch_specs().items():
        gemm = spec[1] == "moe_gemm_kernel"
        specs[name] = (*spec, 3 if gemm else 2) + ((GEMM_DIVISIBLE,) if gemm else ())
    return specs


def _moe_constexprs(stage: int, **over):
    """Per-target constexprs of moe_gemm_kernel at the K3 decode tiles: inline-PTX decode and the fast epilogue
    math on sm_90, portable Triton decode and math on AMD (the decode: also wherever ``DECODE`` is given)."""
    base = dict(STAGE=stage, W_FMT=0, FOLD=True, OP_F32=False, DOT_F32=False, ACT=0, HAS_LINEAR_BETA=True,
                OUT_MX=False, EMAX=8, BIAS=7, FP8_MAX=448.0, EVEN_K=True, SPLIT=1, BMT=16, KU=2, STAGES=3,
                DYNAMIC=False)
    base.update(over)
    # NVIDIA: inline-PTX decode and the fast epilogue math, as fused_moe launches them there (``over`` wins)
    return lambda target: {"DECODE": 0 if target == "sm_90" else 1, "FAST_ACT": target == "sm_90", **base}


def _launch_specs() -> dict:
    """kernel name -> (module, attribute, signature, constexprs, num_warps); MoE tiles as launched at decode (and
    the K-split and prefill variants a MoEConfig can ask for)."""
    align_sig = {"ids_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "start_ptr": "*i32",
                 "count_ptr": "*i32", "nblk_ptr": "*i32", "work_ptr": "*i32", "num_pairs": "i32", "num_experts": "i32",
                 "num_blocks": "i32"}
    mla_decode_sig = {"q_ptr": "*bf16", "qpe_ptr": "*bf16", "kv_ptr": "*bf16", "bt_ptr": "*i32", "lens_ptr": "*i32",
                      "out_ptr": "*bf16", "part_ptr": "*fp32", "lse_ptr": "*fp32", "num_heads": "i32",
                      "block_size": "i32", "scale": "fp32", "stride_qn": "i32", "stride_qh": "i32",
                      "stride_pn": "i32", "stride_ph": "i32", "stride_kvb": "i64", "stride_kvt": "i32",
                      "stride_btn": "i32", "stride_on": "i32", "stride_oh": "i32"}
    mla_prefill_sig = {"qlat_ptr": "*bf16", "q_ptr": "*bf16", "kv_ptr": "*bf16", "bt_ptr": "*i32", "cu_ptr": "*i32",
                       "lens_ptr": "*i32", "blocks_ptr": "*i32", "out_ptr": "*fp32", "block_size": "i32",
                       "scale": "fp32", "stride_ql_t": "i32", "stride_ql_h": "i32", "stride_q_t": "i32",
                       "stride_q_h": "i32", "stride_kvb": "i64", "stride_kvt": "i32", "stride_btn": "i32",
                       "stride_o_t": "i32", "stride_o_h": "i32"}
    from rocm_k3.triton_kernels.moe.kernels import GEMM_SIGNATURE as gemm_sig

    moe = "rocm_k3.triton_kernels.moe.kernels"
    w2_sig = {**gemm_sig, "out_ptr": "*fp32"}
    f32_sig = {**gemm_sig, "a_ptr": "*fp32", "out_ptr": "*fp32"}
    bf16w_sig = {**w2_sig, "w_ptr": "*bf16", "ws_ptr": "*bf16"}
    return {
        "rms_norm": ("rocm_k3.triton_kernels.norm", "_rms_norm_kernel",
                     {"x_ptr": "*bf16", "res_ptr": "*bf16", "gate_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                      "res_out_ptr": "*bf16", "n_rows": "i32", "n_cols": "i32", "stride_x": "i32",
                      "stride_res": "i32", "stride_gate": "i32", "stride_out": "i32", "stride_res_out": "i32",
                      "eps": "fp32", "gate_heads": "i32", "stride_gate_h": "i32"},
                     dict(HAS_RES=True, HAS_GATE=False, ROWS=1, BLOCK_D=8192), 16),
        "attn_res_step": ("rocm_k3.triton_kernels.attn_res", "_attn_res_kernel",
                          {"partial_ptr": "*bf16", "delta_ptr": "*bf16", "blocks_ptr": "*bf16", "proj_ptr": "*bf16",
                           "normw_ptr": "*bf16", "rmsw_ptr": "*bf16", "p_out_ptr": "*bf16", "out_ptr": "*bf16",
                           "n_rows": "i32", "hd": "i32", "num_blocks": "i32", "write_offset": "i64",
                           "stride_part": "i32", "stride_delta": "i32", "stride_bb": "i64", "stride_bt": "i32",
                           "stride_p": "i32", "stride_out": "i32", "eps": "fp32"},
                          dict(HAS_PARTIAL=True, HAS_DELTA=True, WRITE_P=True, WRITE_BLOCK=True, NORM=True, ROWS=1,
                               BLOCK_D=8192, PREFETCH=True), 16),
        "mla_decode": ("rocm_k3.triton_kernels.mla_decode", "_mla_decode_kernel", mla_decode_sig,
                       dict(SPLITS=4, DOT_F32=False, BH=16, BLOCK_N=32, D=512, DR=64, LORA=512, ROPE=64), 4),
        "mla_prefill": ("rocm_k3.triton_kernels.mla_prefill", "_mla_prefill_kernel", mla_prefill_sig,
                        dict(DOT_F32=False, BT=16, BLOCK_N=32, D=512, DR=64, NOPE_DIM=128, LORA=512, ROPE=64), 4),
        # the expanded-heads prefill at its bf16 default tiles per vendor (mla_prefill_expanded.default_tiles:
        # 128 x 128 with 8 warps on sm_90, 32 x 32 with 4 on AMD), K3 widths, the gated last segment
        "mla_prefill_expanded": ("rocm_k3.triton_kernels.mla_prefill_expanded", "_expanded_kernel",
                                 {"q_ptr": "*bf16", "kn_ptr": "*bf16", "v_ptr": "*bf16", "pe_ptr": "*bf16",
                                  "gate_ptr": "*bf16", "out_ptr": "*bf16", "acc_ptr": "*fp32", "ml_ptr": "*fp32",
                                  "n_q": "i32", "q_pos0": "i32", "key0": "i32", "seg_len": "i32",
                                  "scale_log2": "fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_kt": "i32",
                                  "stride_kh": "i32", "stride_pe": "i32", "stride_gt": "i32", "stride_gh": "i32",
                                  "stride_ot": "i32", "stride_oh": "i32"},
                                 lambda target: dict(NOPE=128, ROPE=64, VD=128, DN=128, DR=64, DV=128, FIRST=False,
                                                     LAST=True, HAS_GATE=True, DOT_F32=False,
                                                     BLOCK_M=128 if target == "sm_90" else 32,
                                                     BLOCK_N=128 if target == "sm_90" else 32),
                                 lambda target: 8 if target == "sm_90" else 4),
        # a latent no release uses (kv_lora_rank 48, rope 24, nope 40): padded 64 / 32 tiles with masked columns
        "mla_decode_r48_p24": ("rocm_k3.triton_kernels.mla_decode", "_mla_decode_kernel", mla_decode_sig,
                               dict(SPLITS=4, DOT_F32=False, BH=16, BLOCK_N=32, D=64, DR=32, LORA=48, ROPE=24), 4),
        "mla_prefill_r48_p24": ("rocm_k3.triton_kernels.mla_prefill", "_mla_prefill_kernel", mla_prefill_sig,
                                dict(DOT_F32=False, BT=16, BLOCK_N=32, D=64, DR=32, NOPE_DIM=40, LORA=48, ROPE=24), 4),
        "varlen_attention": ("rocm_k3.triton_kernels.vision_attention", "_varlen_attention_kernel",
                             {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
                              "cu_ptr": "*i32", "scale_log2": "fp32", "stride_qt": "i32", "stride_qh": "i32",
                              "stride_kt": "i32", "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32",
                              "stride_ot": "i32", "stride_oh": "i32"},
                             dict(D=128, DOT_F32=False, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128), 4),
        "moe_route": ("rocm_k3.triton_kernels.moe.pointwise", "_route_kernel",
                      {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i32",
                       "num_experts": "i32", "stride_l": "i32", "scaling_factor": "fp32"},
                      dict(TOP_K=16, HAS_BIAS=True, RENORM=True, BLOCK_E=1024, BLOCK_K=16), 4),
        "moe_align": ("rocm_k3.triton_kernels.moe.align", "_align_kernel", align_sig,
                      # the largest routing it takes; a programmatic dependent launch on sm_90 (as fused_moe_with)
                      lambda target: dict(BM=16, BLOCK_P=1024, BLOCK_E=1024, PDL=target == "sm_90"), 4),
        "moe_align_t1": ("rocm_k3.triton_kernels.moe.align", "_align_kernel", align_sig,
                         dict(BM=16, BLOCK_P=16, BLOCK_E=1024), 2),  # K3 decode at T = 1
        # the chunked align of prefill routings, at K3 sizes (1024-pair chunks, 896 -> 1024 experts)
        "moe_align_count": ("rocm_k3.triton_kernels.moe.align", "_chunk_count_kernel",
                            {"ids_ptr": "*i32", "counts_ptr": "*i32", "num_pairs": "i32"},
                            dict(BLOCK_P=1024, BLOCK_E=1024), 8),
        "moe_align_scan": ("rocm_k3.triton_kernels.moe.align", "_chunk_scan_kernel",
                           {"counts_ptr": "*i32", "before_ptr": "*i32", "block_expert_ptr": "*i32",
                            "start_ptr": "*i32", "count_ptr": "*i32", "nblk_ptr": "*i32", "work_ptr": "*i32",
                            "num_chunks": "i32", "num_experts": "i32", "num_blocks": "i32"},
                           dict(BM=16, BLOCK_E=1024, BLOCK_B=1024), 8),
        "moe_align_scatter": ("rocm_k3.triton_kernels.moe.align", "_chunk_scatter_kernel",
                              {"ids_ptr": "*i32", "counts_ptr": "*i32", "before_ptr": "*i32", "start_ptr": "*i32",
                               "sorted_ptr": "*i32", "num_pairs": "i32", "num_experts": "i32"},
                              dict(BLOCK_P=1024, BLOCK_E=1024), 8),
        "moe_w13_a16w4": (moe, "moe_gemm_kernel", gemm_sig, _moe_constexprs(1), 4),
        "moe_w2_a16w4_split": (moe, "moe_gemm_kernel", w2_sig, _moe_constexprs(2, SPLIT=4), 4),
        "moe_w13_dynamic": (moe, "moe_gemm_kernel", gemm_sig, _moe_constexprs(1, DYNAMIC=True), 4),
        "moe_w2_dynamic": (moe, "moe_gemm_kernel", w2_sig, _moe_constexprs(2, DYNAMIC=True), 4),
        "moe_w13_a8w4": (moe, "moe_gemm_kernel", gemm_sig, _moe_constexprs(1, OUT_MX=True), 4),
        "moe_w2_two_mul": (moe, "moe_gemm_kernel", w2_sig, _moe_constexprs(2, FOLD=False, EVEN_K=False), 4),
        "moe_w13_prefill": (moe, "moe_gemm_kernel", gemm_sig, _moe_constexprs(1, BMT=64), 4),
        "moe_w13_f32": (moe, "moe_gemm_kernel", f32_sig, _moe_constexprs(1, DECODE=1, OP_F32=True), 4),
        "moe_w2_bf16experts": (moe, "moe_gemm_kernel", bf16w_sig, _moe_constexprs(2, DECODE=1, W_FMT=1), 4),
        "moe_w2_f32_bf16experts": (moe, "moe_gemm_kernel", {**bf16w_sig, "a_ptr": "*fp32"},
                                   _moe_constexprs(2, DECODE=1, W_FMT=1, OP_F32=True), 4),
        "moe_topk_reduce": (moe, "topk_reduce_kernel",
                            {"y_ptr": "*fp32", "out_ptr": "*bf16", "Kout": "i32", "stride_y": "i32",
                             "stride_split": "i32", "stride_out": "i32"},
                            lambda target: dict(TOP_K=16, SPLIT=1, BLOCK=256, PDL=target == "sm_90"), 4),
        "moe_mxfp8_round_trip": (moe, "mxfp8_round_trip_kernel",
                                 {"x_ptr": "*bf16", "out_ptr": "*bf16", "n_rows": "i32", "K": "i32",
                                  "stride_x": "i32", "stride_out": "i32"},
                            dict(EMAX=8, BIAS=7, FP8_MAX=448.0, ROWS=4, BLOCK_K=256), 4),
    }


def main(names: list[str]) -> None:
    from rocm_k3.triton_kernels.compile_check import compile_specs

    json.dump(compile_specs(_specs, names, TARGETS), sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
