"""``register()``: the ``vllm.general_plugins`` entry point. vLLM calls it in every process it starts (API server,
engine core, workers) before any model work, so it is idempotent and imports only what registration needs.

It registers, unless ``ROCM_K3_VLLM_DISABLE=1``:
- the model classes under the plugin's own names, and under the released Kimi K3 / Kimi Linear names where the
  plugin takes them (:func:`~.arch.takes_released_names`: the CPU, or ``ROCM_K3_VLLM_OVERRIDE=1``), clearing
  vLLM's cached class lookups so an earlier inspection cannot win;
- the architecture view of the served configs (:class:`~.config_view.RocmK3ArchConvertor`);
- the KDA layers' state-metadata backend (:mod:`.kda_backend`);
- the ``rocm_k3_mxfp4`` quantization method (:mod:`.quant`), which claims MXFP4 checkpoints the plugin serves;
- the ``kimi_k3`` tokenizer mode (vLLM's default for the K3 architecture) as rocm-k3's tokenizer, which reads the
  embedded byte tokenizer and ``tiktoken.model`` and falls back to vLLM's HF tokenizer for anything else.
"""

from __future__ import annotations

from rocm_k3.integrations.vllm.arch import MODEL_CLASSES, PLUGIN_ARCHS, SERVED_MODEL_TYPES, logger, takes_released_names
from rocm_k3.settings import get_settings

TOKENIZER_MODE = "kimi_k3"
TOKENIZER_CLASS = ("rocm_k3.integrations.vllm.tokenizer", "RocmK3Tokenizer")


def register() -> None:
    """Register the plugin's pieces with vLLM (see the module docstring); safe to call more than once."""
    if get_settings().vllm_disable:
        logger.info("ROCM_K3_VLLM_DISABLE=1: the rocm-k3 vLLM plugin registers nothing")
        return
    import vllm.config  # noqa: F401  (fully imported first: the modules below import it back)
    from vllm import ModelRegistry
    from vllm.model_executor.models import registry as model_registry
    from vllm.platforms import current_platform
    from vllm.tokenizers.registry import TokenizerRegistry
    from vllm.transformers_utils.model_arch_config_convertor import MODEL_ARCH_CONFIG_CONVERTORS

    import rocm_k3.integrations.vllm.quant  # noqa: F401  (registers the quantization method on import)
    from rocm_k3.integrations.vllm.config_view import RocmK3ArchConvertor
    from rocm_k3.integrations.vllm.kda_backend import register_backend

    classes = dict(PLUGIN_ARCHS)
    released, why = takes_released_names(current_platform.is_cpu())
    if released:
        classes.update(MODEL_CLASSES)
    for arch, target in classes.items():
        if ModelRegistry.models.get(arch) is None or _target(ModelRegistry, arch) != target:
            ModelRegistry.register_model(arch, target)
    for cached in ("_try_load_model_cls", "_try_inspect_model_cls"):
        getattr(getattr(model_registry, cached, None), "cache_clear", lambda: None)()
    register_backend()  # the KDA state type: every process unpickles it in the layers' cache specs
    for model_type in SERVED_MODEL_TYPES:
        MODEL_ARCH_CONFIG_CONVERTORS[model_type] = RocmK3ArchConvertor
    if released and TokenizerRegistry.tokenizers.get(TOKENIZER_MODE) != TOKENIZER_CLASS:
        TokenizerRegistry.tokenizers[TOKENIZER_MODE] = TOKENIZER_CLASS
    logger.info("rocm-k3 vLLM plugin: registered %s (%s)", sorted(classes), why)


def _target(registry, arch: str) -> str | None:
    """``module:Class`` of a lazily registered architecture (None for other registrations)."""
    model = registry.models.get(arch)
    module, name = getattr(model, "module_name", None), getattr(model, "class_name", None)
    return f"{module}:{name}" if module and name else None
