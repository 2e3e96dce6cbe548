"""Native vision for Kimi K3 (MoonViT-V2) and Kimi K2.5 (MoonViT): SERVING_SPEC section 6.

One job per module:
- ``config``: :class:`VisionConfig` from a checkpoint's ``vision_config`` (the variant follows from its fields).
- ``layers``, ``rope``, ``pos_emb``: norms and linears, the 2-D RoPE, the interpolated position table.
- ``tower``: :class:`VisionTower` (patch embed, pre-norm blocks over per-image varlen attention, final norm,
  ``sd2_tpool`` 2x2 merge); ``projector``: :class:`Projector` (``patchmerger`` / ``patchmergerv2``);
  ``model``: :class:`VisionModel` = ``vision_tower`` + ``mm_projector`` with the checkpoint's tensor names.
- ``preprocess``: Pillow decode, NaViT resize, alpha, pad, normalise, patchify; named image errors.
- ``prompt``: the ``<|media_begin|>...<|media_end|>`` expansion at caller-given positions, image content hashes,
  the prefix-cache key, :func:`scatter_image_embeddings`.
- ``loader``: :func:`load_vision_model` (``vision_tower.*`` / ``mm_projector.*`` of a safetensors checkpoint).
- ``data_parallel``: splitting images across ranks by patch count and gathering the results in order.
- ``tiny``: the tiny seeded K3 tower of ``rocm-k3 make-tiny --vision``.
"""
