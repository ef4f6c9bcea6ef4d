"""Training: the loop (trainer.py), metrics and progress (metrics.py), plots (plot.py)."""
