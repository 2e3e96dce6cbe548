"""FlyDSL kernels for AMD Instinct MI300X (gfx942) and MI355X (gfx950): the ``flydsl`` op backend.

Status: every kernel here compiles for both targets and is ISA-checked by the ``compile`` test tier on a
CPU machine (``toolchain``/``isa``); their thread/element index maps and the MoE weight pre-shuffle are
tested on the host. None has been executed on an AMD GPU by its authors: ``pytest -m rocm`` on an
MI300X/MI355X runs the parity tests against the PyTorch references.

Modules: ``backend`` (registration, availability, MoE weight preparation), ``ops_impl`` and ``moe`` (host
wrappers), kernels ``norm``, ``attn_res``, ``kda_decode``, ``short_conv``, ``kda_chunk_prep`` /
``kda_chunk_intra`` / ``kda_chunk_state`` (chunked KDA prefill), ``kda_prefill`` (its config and the recurrent
fallback), ``moe_gemm``, ``moe_aux``, ``gated_act``, ``mla_prefill`` (expanded-heads MLA prefill; host wrapper
``mla_ops``); ``plans``, ``kda_prefill_plan``, ``mla_prefill_plan`` and ``bitcodes`` (index
maps and number-format bit formulas in plain Python, shared by the kernels and the host tests), ``weights``
(MoE pre-shuffle),
``toolchain`` and ``isa`` (compile-only builds and ISA facts).
Nothing is imported at package import time.
"""
