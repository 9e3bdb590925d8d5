"""How long the outputs a replica is generating now still take, when nothing waits
behind them: the end of a run whose requests all run at once.

Each running output of age `a` (tokens so far) goes on while its length L > a + k at step
k, with L from the calibrated length distribution conditioned on L > a, and stops at
`max_tokens`; a step costs the step-latency model's time for the outputs still running
(their context growing a token a step) and its base time as long as one runs. The sum of
the expected step times is the time left; `local_factor` (the replica's recent steps,
measured over predicted) carries what the machine is doing right now.
"""

from __future__ import annotations

import numpy as np

from batchllm.costmodel.latency import StepLatencyModel
from batchllm.costmodel.lengths import LengthDistribution


def survival(lengths: LengthDistribution, at: np.ndarray) -> np.ndarray:
    """P(L > at) for each value."""
    index = np.searchsorted(lengths.lengths, at, side="right") - 1
    cdf = np.where(index >= 0, lengths.cdf[np.clip(index, 0, None)], 0.0)
    return 1.0 - cdf


def batch_left_s(latency: StepLatencyModel, lengths: LengthDistribution, running: int, age: int, prompt_tokens: float,
                 max_tokens: int, local_factor: float = 1.0) -> float:
    """Expected seconds until the last of `running` outputs of age `age` ends."""
    horizon = int(max_tokens) - int(age)
    if running <= 0 or horizon <= 0:
        return 0.0
    steps = np.arange(horizon)
    alive_now = float(survival(lengths, np.array([age]))[0])
    if alive_now <= 0:  # the distribution says they all ended: one more step each
        alive = np.zeros(horizon)
        alive[0] = 1.0
    else:
        alive = np.clip(survival(lengths, age + steps) / alive_now, 0.0, 1.0)  # P(still running at step k)
    seqs = running * alive
    any_running = 1.0 - (1.0 - alive) ** running
    seconds = (latency.base_s * any_running + latency.per_decode_seq_s * seqs
               + latency.per_context_token_s * seqs * (prompt_tokens + age + steps))
    return float(local_factor * seconds.sum())
