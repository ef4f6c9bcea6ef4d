"""The trainer's own checkpointed state, as stateful parts the checkpoint store saves by name: the step and token
counters, and the random number generators."""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class RunCounters:
    """Where the run is: optimizer steps taken, tokens trained on, and consecutive skipped (non-finite) steps
    (checkpointed as the part ``progress``)."""

    step: int = 0
    tokens: int = 0
    skipped_in_a_row: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens, "skipped_in_a_row": self.skipped_in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))


class RNGState:
    """Python's, numpy's and torch's CPU generators (the same on every rank: each seeds them alike, and training
    draws nothing from them per rank), as text a JSON file can hold."""

    def state_dict(self) -> dict[str, Any]:
        return {"python": base64.b64encode(json.dumps(random.getstate()).encode()).decode(),
                "numpy": base64.b64encode(json.dumps(np.random.get_state()[1].tolist()).encode()).decode(),
                "numpy_pos": int(np.random.get_state()[2]),
                "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        py = json.loads(base64.b64decode(state["python"]))
        random.setstate((py[0], tuple(py[1]), py[2]))
        keys = np.array(json.loads(base64.b64decode(state["numpy"])), dtype=np.uint32)
        np.random.set_state(("MT19937", keys, state["numpy_pos"], 0, 0.0))
        torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()))
