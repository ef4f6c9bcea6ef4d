"""Training: the loop (trainer.py), one optimizer step (step.py), its plan (schedule.py), what attaches to the loop
(callbacks.py, through the hooks.py protocol), metrics and plots (metrics.py, plot.py)."""
