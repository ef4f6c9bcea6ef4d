"""Evaluation: validation loss and perplexity on prepared data (``perplexity``), and lm-eval-harness tasks run
through serve's engine (``harness``)."""
