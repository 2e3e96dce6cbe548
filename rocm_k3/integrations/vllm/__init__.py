"""The vLLM plugin: vLLM's scheduler, cache manager and OpenAI server running Kimi K3 / Kimi Linear on rocm-k3's
model layers and op table (FlyDSL on ROCm, Triton on CUDA, the reference backend on the CPU).

vLLM imports this package through the ``vllm.general_plugins`` entry point (``rocm_k3`` ->
:func:`rocm_k3.integrations.vllm.register.register`) in every vLLM process; nothing else in rocm-k3 imports it.

- :mod:`.register`:   what the plugin registers (model classes, quantization method, tokenizer mode, config view).
- :mod:`.arch`:       which architectures it serves and how vLLM sees their attention (expanded heads).
- :mod:`.model`:      the vLLM model class around rocm-k3's :class:`~rocm_k3.model.decoder.KimiModel`.
- :mod:`.kda_layer`:  the KDA layer as vLLM's state layer (``MambaBase``) and its metadata backend.
- :mod:`.mla_layer`:  MLA through vLLM's standard ``Attention`` with expanded heads.
- :mod:`.quant`:      the quantization method that hands MXFP4 experts to rocm-k3's loader.
- :mod:`.tokenizer`:  rocm-k3's tokenizers (byte, ``tiktoken.model``) and K3 chat format as a vLLM tokenizer.
"""
