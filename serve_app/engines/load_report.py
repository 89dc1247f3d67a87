"""A replica's recent latencies, for the autoscaling metrics it reports (serve_app/config/autoscaling.py).

Kept per replica, over a sliding window: a prefill replica records, per call, the time from the
call's arrival to its prompt computed (what the prompt adds to time to first token: its queueing
and its compute on this engine); a decode replica records the gap between successive outputs of
each stream divided by the tokens the later one brought (inter-token latency, as the client sees
it from this engine). Appending is O(1) per
output; the p90 is computed when Serve asks for the metrics (every few seconds), over at most
``max_samples`` recent values.
"""

from __future__ import annotations

import math
from collections import deque


class LatencyWindow:
    def __init__(self, window_s: float, max_samples: int = 4096) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, now: float, seconds: float) -> None:
        self._samples.append((now, seconds))

    def p90(self, now: float) -> float:
        """The 90th percentile of the values recorded in the last ``window_s`` (0.0: none)."""
        cutoff = now - self.window_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        if not self._samples:
            return 0.0
        values = sorted(v for _, v in self._samples)
        return values[math.ceil(0.9 * len(values)) - 1]  # nearest rank: of 10 values, the 9th
