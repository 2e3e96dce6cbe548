"""Cross-compile every rocm-k3 Triton kernel for sm_90, gfx942 and gfx950 and print a JSON summary.

Run by ``tests/test_triton_ops.py`` (compile tier) in a fresh interpreter *without* ``TRITON_INTERPRET``:
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
    """kernel name -> (module, attribute, signature, constexprs, num_warps, num_stages)."""
    # dot_scaled is launched unpipelined (moe/fused.py: num_stages > 1 miscompiles it on Triton 3.6 / sm_90)
    return {name: (*spec, 1 if name.startswith("moe_w") else 2) for name, spec in _launch_specs().items()}


def _launch_specs() -> dict:
    """kernel name -> (module, attribute, signature, constexprs, num_warps); MoE tiles as launched at decode."""
    moe_ptrs = {"a_ptr": "*bf16", "as_ptr": "*u8", "w_ptr": "*u8", "ws_ptr": "*u8", "sorted_ptr": "*i32",
                "block_expert_ptr": "*i32", "start_ptr": "*i32", "count_ptr": "*i32"}
    w13_sig = {**moe_ptrs, "out_ptr": "*bf16", "out_s_ptr": "*u8", "K": "i32", "N": "i32", "top_k": "i32",
               "stride_a": "i32", "stride_as": "i32", "stride_we": "i64", "stride_wn": "i32", "stride_wse": "i64",
               "stride_wsn": "i32", "stride_out": "i32", "stride_out_s": "i32", "beta": "fp32",
               "linear_beta": "fp32"}
    w2_sig = {**moe_ptrs, "a_ptr": "*u8", "y_ptr": "*fp32", "topk_w_ptr": "*fp32", "K": "i32", "N": "i32",
              "stride_a": "i32", "stride_as": "i32", "stride_we": "i64", "stride_wn": "i32", "stride_wse": "i64",
              "stride_wsn": "i32", "stride_y": "i32"}
    moe_ce = dict(W_FMT=0, OP_F32=False, DOT_F32=False, BIAS=7, F16_DECODE=False, BM=16, BN=32, BK=64)
    fma_ce = dict(moe_ce, W_FMT=4, BM=1, BK=128)  # the decode GEMV on fp32 multiply-adds
    # fp32 activations: fp32 operands, IEEE dots (manual E2M1 decode for MXFP4; bf16 experts widened to fp32)
    f32_ce = dict(moe_ce, OP_F32=True, A_MX=False)
    w13_f32_sig = {**w13_sig, "a_ptr": "*fp32", "out_ptr": "*fp32"}
    w2_f32_sig = {**w2_sig, "a_ptr": "*fp32", "w_ptr": "*bf16"}
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
    return {
        "rms_norm": ("rocm_k3.triton_kernels.norm", "_rms_norm_kernel",
                     {"x_ptr": "*bf16", "res_ptr": "*bf16", "gate_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                      "res_out_ptr": "*bf16", "n_rows": "i32", "n_cols": "i32", "stride_x": "i32",
                      "stride_res": "i32", "stride_gate": "i32", "stride_out": "i32", "stride_res_out": "i32",
                      "eps": "fp32"},
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
        "moe_align": ("rocm_k3.triton_kernels.moe.align", "_align_kernel",
                      {"ids_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "start_ptr": "*i32",
                       "count_ptr": "*i32", "num_pairs": "i32", "num_experts": "i32", "num_blocks": "i32"},
                      dict(BM=16, BLOCK_A=64, BLOCK_E=1024), 8),
        "moe_w13_a16w4": ("rocm_k3.triton_kernels.moe.kernels", "w13_kernel", w13_sig,
                          dict(moe_ce, A_MX=False, ACT=0, HAS_LINEAR_BETA=True, OUT_MX=False, EMAX=8, FP8_MAX=448.0), 4),
        "moe_w13_bits": ("rocm_k3.triton_kernels.moe.kernels", "w13_kernel", w13_sig,
                         dict(moe_ce, W_FMT=3, A_MX=False, ACT=0, HAS_LINEAR_BETA=True, OUT_MX=False, EMAX=8,
                              FP8_MAX=448.0), 4),
        "moe_w2_a8w4": ("rocm_k3.triton_kernels.moe.kernels", "w2_kernel", w2_sig, dict(moe_ce, A_MX=True), 4),
        "moe_w13_fma": ("rocm_k3.triton_kernels.moe.kernels", "w13_kernel", w13_sig,
                        dict(fma_ce, A_MX=False, ACT=0, HAS_LINEAR_BETA=True, OUT_MX=False, EMAX=8, FP8_MAX=448.0), 4),
        "moe_w2_fma_f16": ("rocm_k3.triton_kernels.moe.kernels", "w2_kernel", w2_sig,
                           dict(fma_ce, F16_DECODE=True, A_MX=False), 4),
        "moe_w13_gemv_f16": ("rocm_k3.triton_kernels.moe.kernels", "w13_kernel", w13_sig,
                             dict(fma_ce, W_FMT=5, BN=64, F16_DECODE=True, A_MX=False, ACT=0, HAS_LINEAR_BETA=True,
                                  OUT_MX=False, EMAX=8, FP8_MAX=448.0), 4),
        "moe_w2_gemv_a8w4": ("rocm_k3.triton_kernels.moe.kernels", "w2_kernel", w2_sig,
                             dict(fma_ce, W_FMT=5, BN=64, A_MX=True), 4),
        "moe_w13_f32": ("rocm_k3.triton_kernels.moe.kernels", "w13_kernel", w13_f32_sig,
                        dict(f32_ce, W_FMT=2, ACT=0, HAS_LINEAR_BETA=True, OUT_MX=False, EMAX=8, FP8_MAX=448.0), 4),
        "moe_w2_f32_bf16experts": ("rocm_k3.triton_kernels.moe.kernels", "w2_kernel", w2_f32_sig,
                                   dict(f32_ce, W_FMT=1), 4),
        "moe_mxfp8_quant": ("rocm_k3.triton_kernels.moe.kernels", "mxfp8_quant_kernel",
                            {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8", "n_rows": "i32", "K": "i32",
                             "stride_x": "i32", "stride_q": "i32", "stride_s": "i32"},
                            dict(EMAX=8, BIAS=7, FP8_MAX=448.0, ROWS=4, BLOCK_K=256), 4),
    }


def main(names: list[str]) -> None:
    from rocm_k3.triton_kernels.compile_check import compile_specs

    json.dump(compile_specs(_specs, names, TARGETS), sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
