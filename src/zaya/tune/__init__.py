"""Hardware tuning and capacity planning: ``zaya tune gemm``, ``zaya tune comm`` (``zaya plan`` is not built yet).

* ``profile``: the per-device hardware profile that the tuned constants come from (docs/tuning.md).
* ``gemm``: GEMM throughput by the model's shapes, a heatmap, and shape recommendations.
* ``comm``: collective bandwidth by message size and ranks, and the bucket sizes it recommends.
"""
