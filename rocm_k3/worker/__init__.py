"""The data plane: one worker per device owns the model, the KV/state pools, decode graphs and the sampler.

``step_io`` (the picklable step contract) imports no torch; import the other submodules directly.
"""
