"""The hybrid cache's integer bookkeeping (block pool, KDA slots, prefix index, manager, invariants).

Plain Python over ids: no tensors and no model code. The tensor pools it describes live on the workers
(:mod:`rocm_k3.worker.kv_pools`). Import the submodules directly.
"""
