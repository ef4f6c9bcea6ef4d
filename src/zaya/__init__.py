"""zaya: train, continue-train and serve ZAYA1-style Mixture-of-Experts language models."""

__version__ = "0.1.0"


def load_pretrained(path, dtype=None, device="cpu"):
    """A ``ZayaForCausalLM`` in eval mode from a run directory (its newest checkpoint that passes verification; each
    newer one skipped is named on stderr), a training checkpoint (any world size), a zaya checkpoint or a Hugging
    Face ``zaya`` directory; the same loader as ``zaya generate``/``eval``/``export``
    (``zaya.checkpoint.consolidate.load_for_inference``). The files are read as data, never code, and checked (an
    export's ``SHA256SUMS``, every tensor): anything wrong is a ``zaya.core.errors.CheckpointError`` naming the file.
    Tensors keep their stored dtype unless ``dtype`` (a torch.dtype) is given."""
    from zaya.checkpoint.consolidate import load_for_inference

    return load_for_inference(path, device=device, dtype=dtype)[0]


def generate(model, input_ids, max_new_tokens, **options):
    """Sample ``max_new_tokens`` after ``input_ids`` [B, T] with ``model`` (temperature, top_k, top_p, seed,
    attention_mask, eos_token_id as keywords): ``zaya.serve.generate.generate``, the decoding ``zaya generate`` and
    ``zaya serve`` run. Returns [B, T + max_new_tokens]."""
    from zaya.serve.generate import generate as run

    return run(model, input_ids, max_new_tokens, **options)


__all__ = ["__version__", "generate", "load_pretrained"]
