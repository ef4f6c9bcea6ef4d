"""The policy: what a finding leads to, from the ``[aegis]`` table (``aegis.on_<kind>``), and when to stop trying.

Actions: ``restart`` (relaunch; the trainer resumes from the newest good checkpoint, the RAM tier first),
``rewind`` (relaunch from a checkpoint before the bad step, skip its batches, optionally cut the LR for a while),
``exclude`` (relaunch without the bad device or rank: a spare takes its place, or the job continues on fewer
ranks, the checkpoint resharding to the new world size), ``backoff`` (wait, doubling each time, then relaunch: for
transient network faults), ``alert`` (record it, change nothing), ``give_up`` (stop with a diagnosis and the
fault's exit code). The same fault seen more than ``max_repeats`` times is given up on, so a fault that a relaunch
does not cure ends the run instead of looping.
"""

from __future__ import annotations

from dataclasses import dataclass

from zaya.aegis.detectors import Finding

ACTIONS = ("restart", "rewind", "exclude", "backoff", "alert", "give_up")


@dataclass
class Decision:
    action: str
    reason: str
    repeat: int
    """How many times this fault has now been seen (1 the first time)."""
    wait_s: float = 0.0
    exit_code: int = 0


class Policy:
    def __init__(self, cfg):
        self.cfg = cfg
        self.seen: dict[str, int] = {}

    def decide(self, finding: Finding) -> Decision:
        """The action for ``finding``; counts it among the repeats of its fault (alerts are never given up on)."""
        cfg = self.cfg
        action = finding.forced_action or getattr(cfg, f"on_{finding.action_key}")
        if action == "alert":
            return Decision("alert", f"aegis.on_{finding.action_key} = \"alert\"" if not finding.forced_action
                            else "noted (nothing to repair)", self.seen.get(finding.fault, 0))
        n = self.seen[finding.fault] = self.seen.get(finding.fault, 0) + 1
        if finding.forced_action == "give_up":
            return Decision("give_up", f"{finding.detector}: a relaunch cannot fix this (exit code "
                            f"{finding.exit_code}); fix the cause and run again", n, exit_code=finding.exit_code)
        if n > cfg.max_repeats:
            return Decision("give_up", f"{finding.fault} seen {n} times > aegis.max_repeats = {cfg.max_repeats}",
                            n, exit_code=finding.exit_code)
        wait = min(cfg.backoff_s * 2 ** (n - 1), cfg.backoff_max_s) if action == "backoff" else 0.0
        return Decision(action, f"aegis.on_{finding.action_key} = \"{action}\" ({n} of at most {cfg.max_repeats})",
                        n, wait_s=wait, exit_code=finding.exit_code)
