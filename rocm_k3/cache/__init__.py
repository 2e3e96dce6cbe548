"""The hybrid cache: integer bookkeeping (block pool, KDA slots, prefix index, manager, invariants) and the
tensor pools behind it (:mod:`rocm_k3.cache.hybrid_cache`). Import the submodules directly."""
