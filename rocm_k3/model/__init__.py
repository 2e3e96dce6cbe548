"""The Kimi K3 / Kimi Linear text model: config, layers, decoder, checkpoint loader, caches.

Entry points: :func:`rocm_k3.model.loader.load_model` (checkpoint -> :class:`rocm_k3.model.decoder.KimiModel`),
:class:`rocm_k3.model.forward_batch.ForwardBatch` and ``HybridCacheView`` (the model <-> cache interface),
the test helper ``SimpleCache`` (tests/simple_cache.py), and :mod:`rocm_k3.model.tiny` (the embedded checkpoint).
"""
