"""Optimizers."""

from zaya.optim.muon import Muon, zeropower_via_newtonschulz

__all__ = ["Muon", "zeropower_via_newtonschulz"]
