"""The top floor: measure this machine and plan a run (docs/tuning.md).

* ``gemm``: ``zaya tune gemm``, GEMM throughput by the model's shapes and the shapes and micro-batch it recommends.
* ``comm``: ``zaya tune comm``, collective bandwidth by message size and ranks, and the bucket sizes it recommends.
* ``plan``: ``zaya plan``, memory, time, communication, checkpoint and data needs of a config on a cluster
  (``activation_trace`` and ``live_memory`` count its activation memory and check it against real runs).
* ``report``: what the commands share around a measurement; only they write the hardware profile, which
  ``zaya.core.hardware`` reads for everyone.
"""
