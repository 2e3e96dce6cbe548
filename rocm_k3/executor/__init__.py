"""Executors run a :class:`~rocm_k3.worker.step_io.StepInput` on the workers: in-process (``uniproc``) or on
several ranks (``multiproc``). Import the submodules directly."""
