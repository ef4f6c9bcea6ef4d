"""Optimizers: Muon (``muon``; its Newton-Schulz math in ``newton_schulz``, its work split across ranks in
``muon_distributed``) and the parameter split, schedule and batch ramp the trainer uses (``build``)."""

from zaya.optim.muon import Muon
from zaya.optim.newton_schulz import orthogonalize, zeropower_via_newtonschulz

__all__ = ["Muon", "orthogonalize", "zeropower_via_newtonschulz"]
