"""``zaya tune gemm``: the throughput of every weight GEMM the model runs, by token count and width, and the model
shape and micro-batch it recommends near a parameter budget (docs/tuning.md).

``shapes`` (what is timed), ``timing`` (one GEMM), ``sweep`` (all of them), ``predict`` (the cost model),
``recommend`` (the ranking), ``text`` and ``heatmap`` (the report), ``options`` and ``command`` (the CLI).
"""
