"""zaya: train, continue-train and serve ZAYA1-style Mixture-of-Experts language models."""

__version__ = "0.1.0"


def load_pretrained(path, **kwargs):
    """Load a model from a Hugging Face `zaya` directory or a zaya checkpoint (see zaya.model.io)."""
    from zaya.model.io import load_pretrained as _load

    return _load(path, **kwargs)


__all__ = ["__version__", "load_pretrained"]
