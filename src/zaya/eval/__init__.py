"""Evaluation: validation loss and perplexity on prepared data (lm-eval-harness comes later)."""
