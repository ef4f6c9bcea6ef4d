"""The ZAYA1 model: CCA attention, ZAYA1 router, stacked-weight experts, residual scaling, decoding."""

from zaya.model.io import load_checkpoint, save_checkpoint
from zaya.model.router import update_balancing_biases
from zaya.model.zaya import DecodeState, ZayaForCausalLM, ZayaOutput

__all__ = ["DecodeState", "ZayaForCausalLM", "ZayaOutput", "load_checkpoint", "save_checkpoint",
           "update_balancing_biases"]
