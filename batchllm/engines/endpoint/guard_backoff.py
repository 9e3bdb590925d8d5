"""The latency guard's HELD backoff: when one batch request beside online ones was too many, how long
the batch waits before it tries 1 beside them again, and whether their load eased sooner.

Invariant: the wait is `held_retry_s` x 2 ** (holds in a row - 1), at most `max_held_retry_s`; the
count in a row ends (`clear`) after a lull or once the batch was judged at 2 beside online requests.
"""

from __future__ import annotations

import math

from batchllm.engines.endpoint.guard_evidence import WindowEvidence, judge, load_eased
from batchllm.engines.endpoint.guard_policy import GuardPolicy, Verdict
from batchllm.engines.endpoint.guard_targets import GuardTargets


class HoldBackoff:
    """The holds in a row, when the last began and the online load it was judged too many beside."""

    def __init__(self, policy: GuardPolicy) -> None:
        self.policy = policy
        self.in_a_row = 0
        self._since_s = -math.inf
        self._beside: WindowEvidence | None = None  # the window whose online load one batch request was too many beside

    def hold(self, now_s: float, beside: WindowEvidence | None) -> None:
        """A hold begins now; `beside`: the online load over the last window, whatever the level's age."""
        self._since_s, self._beside, self.in_a_row = now_s, beside, self.in_a_row + 1

    def clear(self) -> None:
        """No backoff left to double: a lull came, or 2 were judged harmless beside online requests."""
        self.in_a_row = 0

    def retry_due(self, now_s: float) -> bool:
        return now_s - self._since_s >= min(self.policy.max_held_retry_s, self.policy.held_retry_s * 2 ** max(0, self.in_a_row - 1))

    def eased(self, level: WindowEvidence | None, targets: GuardTargets | None) -> bool:
        """The online traffic now comes at a lower rate than the one a batch request was too many beside,
        beyond its noise (`rising_sigmas`), and the window at 0 shows positive evidence of room, as any
        growth needs: one batch request was judged beside that load, not this one. Without it, held in
        (a)'s heavy phase, the batch sat at 0 through the light phase after it (a try 60 s later),
        where one request in flight kept the SLO (coserve matrix, AVX-512 host, 2026-11-29)."""
        if level is None or self._beside is None or targets is None:
            return False
        return load_eased(self._beside, level, self.policy.rising_sigmas) and judge(level, targets, self.policy) is Verdict.GROW
