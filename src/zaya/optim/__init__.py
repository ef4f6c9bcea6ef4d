"""Optimizers."""

from zaya.optim.muon import Muon, orthogonalize, zeropower_via_newtonschulz

__all__ = ["Muon", "orthogonalize", "zeropower_via_newtonschulz"]
