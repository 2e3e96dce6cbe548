"""Cross-compile every Triton KDA kernel for sm_90, gfx942 and gfx950 at K3 shapes and print a JSON summary.

Run by ``tests/kernels/triton/test_triton_kda.py`` (compile tier) in a fresh interpreter without ``TRITON_INTERPRET`` (Triton
decides at import time whether every ``@triton.jit`` is interpreted). The launch options (num_warps,
num_stages) and constexprs are the ones the wrappers use for bf16 activations, H = 96, K = V = 128.
Output: ``{"<kernel>/<target>": {"ok", "error", "mnemonics", "registers", "spills", "scratch"}}`` on stdout.
"""

from __future__ import annotations

import json
import sys

TARGETS = ("sm_90", "gfx942", "gfx950")
H, K, V, W = 96, 128, 128, 4


def _fast_exp() -> bool:
    """prefill.FAST_EXP, as the wrappers pass it to the prep and the intra kernel."""
    from rocm_k3.triton_kernels.kda.prefill import FAST_EXP

    return FAST_EXP


def _prep_spec(pkg: str, plan: dict, split: bool, warps: int, gate_only: bool = False, factors: bool = False) -> tuple:
    """chunk_prep over one column slice per program (split) or all of them; writing q', k', QG, KD, G, GL and b, or
    (gate_only, prefill.NORMS_IN_INTRA) G, GL and b alone, or (factors, prefill.GATE_FACTORS) bf16 E, G_m, GL, b."""
    return (f"{pkg}.chunk_prep", "chunk_prep_kernel",
            {**plan, "q_ptr": "*bf16", "k_ptr": "*bf16", "g_ptr": "*bf16", "beta_ptr": "*bf16",
             "a_log_ptr": "*fp32", "dt_bias_ptr": "*fp32", "qn_ptr": "*bf16", "kn_ptr": "*bf16",
             "gcum_ptr": "*bf16" if factors else "*fp32", "beta_out_ptr": "*fp32", "qg_ptr": "*bf16",
             "kd_ptr": "*bf16", "glast_ptr": "*fp32", "gref_ptr": "*fp32", "scale": "fp32", "lower_bound": "fp32",
             "stride_q": "i32", "stride_k": "i32"},
            dict(H=H, K=K, BT=64, BK=32, HAS_GATE=True, SAFE_GATE=True, QK_NORM=True, BETA_LOGITS=True,
                 COL_SPLIT=split, GATE_ONLY=gate_only, FAST_EXP=_fast_exp(), FACTORS=factors), warps, 1)


def _intra_spec(pkg: str, plan: dict, dots: dict, kb: bool, warps: int, inv: bool = False,
                prod: bool = False, raw: bool = False, band: str = "*fp32", factors: bool = False,
                neg_l: bool = False) -> tuple:
    """chunk_intra without (kb False) or with KB written (prefill.SOLVE_KB), storing A_II or (inv,
    prefill.INTRA_INVERTS) T_II in the diagonal blocks, inverted row by row or (prod, prefill.INVERT_BY_PRODUCTS)
    as a product of four factors; reading q', k' or (raw, prefill.NORMS_IN_INTRA) the raw q, k, normalising them
    itself and writing QG and KD too; the A band in ``band`` (prefill.BAND_IN_DOT_DTYPE: bf16); reading G or
    (factors, prefill.GATE_FACTORS) the prep's bf16 E and fp32 G_m; storing A_IJ or (neg_l, prefill.WALK_HORNER)
    -T_II A_IJ below the diagonal."""
    return (f"{pkg}.chunk_intra", "chunk_intra_kernel",
            {**plan, "qn_ptr": "*bf16", "kn_ptr": "*bf16", "gcum_ptr": "*bf16" if factors else "*fp32",
             "beta_ptr": "*fp32", "stride_q": "i32", "stride_k": "i32", "scale": "fp32", "a_ptr": band,
             "aqk_ptr": "*bf16", "kb_ptr": "*bf16", "qg_ptr": "*bf16", "kd_ptr": "*bf16", "gref_ptr": "*fp32"},
            dict(H=H, K=K, **dots, WRITE_KB=kb, INVERT_DIAG=inv, INVERT_PRODUCTS=prod, RAW_QK=raw, QK_NORM=True,
                 FAST_EXP=_fast_exp(), FACTORS=factors, NEG_L=neg_l), warps, 2)


def _solve_spec(pkg: str, plan: dict, dots: dict, kb: bool, warps: int, bd: int, inv: bool = False,
                prod: bool = False) -> tuple:
    """chunk_solve reading k' and G (kb False) or intra's KB (prefill.SOLVE_KB), inverting the diagonal blocks
    (row by row, or by products: prod, prefill.INVERT_BY_PRODUCTS) or (inv, prefill.INTRA_INVERTS) reading intra's
    inverses."""
    return (f"{pkg}.chunk_solve", "chunk_solve_kernel",
            {**plan, "a_ptr": "*fp32", "kn_ptr": "*bf16", "v_ptr": "*bf16", "gcum_ptr": "*fp32",
             "beta_ptr": "*fp32", "w_ptr": "*bf16", "u_ptr": "*bf16", "stride_v": "i32"},
            dict(H=H, K=K, V=V, BD=bd, **dots, KB=kb, DIAG_INVERTED=inv, INVERT_PRODUCTS=prod), warps, 1)


def _specs() -> dict:
    """kernel name -> (module, attribute, signature, constexprs, num_warps, num_stages[, divisible_by_16[, maxnreg]])
    (compile_check.KernelSpec)."""
    import triton.language as tl

    from rocm_k3.triton_kernels.kda.decode import DECODE_PREFETCH, DECODE_WARPS
    from rocm_k3.triton_kernels.kda.prefill import INTRA_MAXNREG, PHASE_WARPS, SOLVE_BD, state_stages, state_tile

    plan = {"chunk_seq_ptr": "*i32", "chunk_start_ptr": "*i32", "cu_seqlens_ptr": "*i32"}
    dots = {"DOT_T": tl.bfloat16, "PREC": "ieee"}
    bv, state_warps = state_tile(H, V)  # one 4096-token sequence of K3: 96 heads
    pkg = "rocm_k3.triton_kernels.kda"
    state_sig = {"w_ptr": "*bf16", "u_ptr": "*bf16", "qg_ptr": "*bf16", "kd_ptr": "*bf16", "aqk_ptr": "*bf16",
                 "glast_ptr": "*fp32", "cu_seqlens_ptr": "*i32", "seq_first_chunk_ptr": "*i32", "state_ptr": "*fp32",
                 "state_indices_ptr": "*i32", "has_init_ptr": "*i8", "o_ptr": "*bf16", "inter_ptr": "*fp32",
                 "inter_map_ptr": "*i32", "hbuf_ptr": "*bf16", "vbuf_ptr": "*bf16", "a_ptr": "*fp32", "kb_ptr": "*bf16",
                 "v_ptr": "*bf16", "b_ptr": "*fp32", "stride_v": "i32"}
    return {
        "kda_gate": (f"{pkg}.gate", "kda_gate_kernel",
                     {"f_ptr": "*bf16", "a_log_ptr": "*fp32", "dt_bias_ptr": "*fp32", "g_ptr": "*fp32", "T": "i32",
                      "lower_bound": "fp32"}, dict(H=H, K=K, BT=16, SAFE_GATE=True), 4, 2),
        "chunk_plan": (f"{pkg}.common", "chunk_plan_kernel",
                       {"cu_seqlens_ptr": "*i32", "chunk_seq_ptr": "*i32", "chunk_start_ptr": "*i32",
                        "seq_first_ptr": "*i32", "N": "i32", "num_slots": "i32"},
                       dict(BT=64, NP=8, BLOCK=1024), 4, 2),
        "short_conv": (f"{pkg}.short_conv", "short_conv_kernel",
                       {**plan, "x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "C": "i32", "stride_x": "i32"},
                       dict(W=W, BT=32, BC=128, SILU=True), 4, 2),
        "conv_history": (f"{pkg}.short_conv", "conv_history_kernel",
                         {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "conv_state_ptr": "*bf16",
                          "state_indices_ptr": "*i32", "has_init_ptr": "*i8", "cu_seqlens_ptr": "*i32", "C": "i32",
                          "stride_x": "i32"}, dict(W=W, WP=4, BC=128, SILU=True), 4, 2),
        "conv_state": (f"{pkg}.short_conv", "conv_state_kernel",
                       {"x_ptr": "*bf16", "conv_state_ptr": "*bf16", "state_indices_ptr": "*i32",
                        "has_init_ptr": "*i8", "cu_seqlens_ptr": "*i32", "C": "i32", "stride_x": "i32"},
                       dict(W=W, WP=4, BC=128), 4, 2),
        "short_conv_update": (f"{pkg}.short_conv", "short_conv_update_kernel",
                              {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "conv_state_ptr": "*bf16",
                               "state_indices_ptr": "*i32", "C": "i32"}, dict(W=W, WP=4, BC=128, SILU=True), 4, 2),
        "chunk_prep": _prep_spec(pkg, plan, split=False, warps=PHASE_WARPS["prep"]),
        "chunk_prep_split": _prep_spec(pkg, plan, split=True, warps=PHASE_WARPS["prep_split"]),
        "chunk_intra": _intra_spec(pkg, plan, dots, False, PHASE_WARPS["intra"]),
        "chunk_intra_kb": _intra_spec(pkg, plan, dots, True, PHASE_WARPS["intra"]),
        "chunk_solve": _solve_spec(pkg, plan, dots, False, PHASE_WARPS["solve"], SOLVE_BD),
        "chunk_solve_kb": _solve_spec(pkg, plan, dots, True, PHASE_WARPS["solve"], SOLVE_BD),
        "chunk_intra_inv": _intra_spec(pkg, plan, dots, True, PHASE_WARPS["intra"], inv=True),
        "chunk_solve_inv": _solve_spec(pkg, plan, dots, True, PHASE_WARPS["solve"], SOLVE_BD, inv=True),
        # prefill.INVERT_BY_PRODUCTS: the diagonal blocks inverted by six 16 x 16 x 16 fp32 products
        "chunk_solve_kb_prod": _solve_spec(pkg, plan, dots, True, PHASE_WARPS["solve"], SOLVE_BD, prod=True),
        "chunk_intra_inv_prod": _intra_spec(pkg, plan, dots, True, PHASE_WARPS["intra"], inv=True, prod=True),
        # the default (session 21): prefill.NORMS_IN_INTRA, the prep gates and sums only, the intra kernel normalises
        # q, k and writes QG, KD; BAND_IN_DOT_DTYPE, the intra kernel stores the A band in bf16, the solving walk
        # reads it
        "chunk_prep_split_gate": _prep_spec(pkg, plan, split=True, warps=PHASE_WARPS["prep_gate"], gate_only=True),
        "chunk_intra_inv_prod_norms": _intra_spec(pkg, plan, dots, True, PHASE_WARPS["intra"], inv=True, prod=True,
                                                  raw=True, band="*bf16"),
        # ... as launched on NVIDIA: under prefill.INTRA_MAXNREG's register cap (session 25)
        "chunk_intra_inv_prod_norms_capped": _intra_spec(pkg, plan, dots, True, PHASE_WARPS["intra"], inv=True,
                                                         prod=True, raw=True, band="*bf16") + (None, INTRA_MAXNREG),
        # the default since session 29, prefill.GATE_FACTORS: the prep writes bf16 E = exp(G - G_m) and G_m, the
        # intra kernel forms its factors from them (uncapped, and as launched on NVIDIA under the register cap)
        "chunk_prep_split_gate_factors": _prep_spec(pkg, plan, split=True, warps=PHASE_WARPS["prep_gate"],
                                                    gate_only=True, factors=True),
        "chunk_intra_factors": _intra_spec(pkg, plan, dots, True, PHASE_WARPS["intra"], inv=True, prod=True,
                                           raw=True, band="*bf16", factors=True),
        "chunk_intra_factors_capped": _intra_spec(pkg, plan, dots, True, PHASE_WARPS["intra"], inv=True, prod=True,
                                                  raw=True, band="*bf16", factors=True) + (None, INTRA_MAXNREG),
        "chunk_state_solve_band16": (f"{pkg}.chunk_state", "chunk_state_kernel", {**state_sig, "a_ptr": "*bf16"},
                                     dict(H=H, K=K, V=V, BV=bv, HAS_INTER=True, WITH_OUTPUT=True, **dots,
                                          SOLVE_IN=True), state_warps, state_stages(bv, solve_in=True)),
        # prefill.WALK_HORNER: the intra kernel storing -L below the diagonal (as launched, capped) and the solving
        # walk with whole-chunk products (Y = T_D X, V' = (I - L)(I + L^2) Y) at its HORNER_WALK_STAGES
        "chunk_intra_negl_capped": _intra_spec(pkg, plan, dots, True, PHASE_WARPS["intra"], inv=True, prod=True,
                                               raw=True, band="*bf16", factors=True, neg_l=True)
                                   + (None, INTRA_MAXNREG),
        "chunk_state_horner": (f"{pkg}.chunk_state", "chunk_state_kernel", {**state_sig, "a_ptr": "*bf16"},
                               dict(H=H, K=K, V=V, BV=bv, HAS_INTER=True, WITH_OUTPUT=True, **dots, SOLVE_IN=True,
                                    HORNER=True), state_warps, state_stages(bv, solve_in=True, horner=True)),
        "chunk_state": (f"{pkg}.chunk_state", "chunk_state_kernel", state_sig,
                        dict(H=H, K=K, V=V, BV=bv, HAS_INTER=True, WITH_OUTPUT=True, **dots, SOLVE_IN=False),
                        state_warps, state_stages(bv)),
        "chunk_state_split": (f"{pkg}.chunk_state", "chunk_state_kernel", state_sig,
                              dict(H=H, K=K, V=V, BV=bv, HAS_INTER=True, WITH_OUTPUT=False, **dots, SOLVE_IN=False),
                              state_warps, state_stages(bv)),
        # SOLVE_IN_WALK: the walk with the WY solve inside (prefill.SOLVE_IN_WALK)
        "chunk_state_solve": (f"{pkg}.chunk_state", "chunk_state_kernel", state_sig,
                              dict(H=H, K=K, V=V, BV=bv, HAS_INTER=True, WITH_OUTPUT=True, **dots, SOLVE_IN=True),
                              state_warps, state_stages(bv, solve_in=True)),
        "chunk_output": (f"{pkg}.chunk_output", "chunk_output_kernel",
                         {**plan, "qg_ptr": "*bf16", "aqk_ptr": "*bf16", "hbuf_ptr": "*bf16", "vbuf_ptr": "*bf16",
                          "o_ptr": "*bf16"}, dict(H=H, K=K, V=V, BV=64, **dots), 4, 2),
        "kda_decode": (f"{pkg}.decode", "kda_decode_kernel",
                       {"qkv_ptr": "*bf16", "f_ptr": "*bf16", "beta_ptr": "*bf16", "out_gate_ptr": "*bf16",
                        "conv_w_ptr": "*bf16", "conv_state_ptr": "*bf16", "a_log_ptr": "*fp32",
                        "dt_bias_ptr": "*fp32", "norm_w_ptr": "*bf16", "state_ptr": "*fp32",
                        "state_indices_ptr": "*i32", "y_ptr": "*bf16", "scale": "fp32", "lower_bound": "fp32",
                        "eps": "fp32"}, dict(H=H, K=K, W=W, WP=4, SAFE_GATE=True, PREFETCH_STATE=DECODE_PREFETCH),
                       DECODE_WARPS, 2),
    }


def main(names: list[str]) -> None:
    from rocm_k3.triton_kernels.compile_check import compile_specs

    json.dump(compile_specs(_specs, names, TARGETS), sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
