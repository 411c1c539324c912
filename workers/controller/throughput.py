"""Each generator replica's measured throughput, by which the dispatcher splits a batch (dispatch.py)."""

from __future__ import annotations

import threading

# Weight of a replica's newest measurement: its rate follows a change of speed (a throttled GPU, a neighbour's
# load) within a few parts, and one odd part moves it only halfway.
SMOOTHING = 0.5
# The rate of every replica while none was measured: only the ratios between replicas matter.
PRIOR = 1.0


class Throughput:
    """Tokens a second of Generate time per replica, exponentially weighted over the parts it finished.

    A replica not measured yet counts as the mean of those that were (PRIOR while none was), so it gets an even
    share until its first part is in. Generate time only: the environment's turns and the controller's stages take
    as long whichever replica generated. On a GPU a smaller part runs at a lower rate (a smaller engine batch), so
    the split moves to the balance over a few steps rather than in one."""

    def __init__(self):
        self._rates: dict[int, float] = {}
        self._lock = threading.Lock()

    def observe(self, replica: int, tokens: int, seconds: float) -> None:
        """`replica` generated `tokens` in `seconds` of Generate calls (a part it finished)."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        with self._lock:
            old = self._rates.get(replica)
            self._rates[replica] = rate if old is None else SMOOTHING * rate + (1 - SMOOTHING) * old

    def measured(self) -> dict[int, float]:
        """The rate of each replica measured so far."""
        with self._lock:
            return dict(self._rates)

    def fields(self) -> dict[str, float]:
        """metrics.jsonl's `generator_throughput/<replica>`, tokens a second, of the replicas measured so far."""
        return {f"generator_throughput/{replica}": rate for replica, rate in sorted(self.measured().items())}

    def rate(self, replica: int) -> float:
        """`replica`'s rate, or the prior of one not measured yet."""
        with self._lock:
            return self._rate(replica)

    def shares(self, replicas: list[int]) -> list[float]:
        """Each of `replicas`' fraction of their summed rate, in their order."""
        with self._lock:
            rates = [self._rate(replica) for replica in replicas]
        return [rate / sum(rates) for rate in rates]

    def _rate(self, replica: int) -> float:
        prior = sum(self._rates.values()) / len(self._rates) if self._rates else PRIOR
        return self._rates.get(replica, prior)


def part_sizes(total: int, shares: list[float]) -> list[int]:
    """`total` whole groups split as `shares` say, by largest remainder (ties to the earlier), sizes summing to
    `total`; each share gets one group at least while there are groups enough (the earlier first), taken from the
    largest part: a replica too slow for its own group still gets one, so that its rate keeps being measured (a
    first measurement slowed by an engine's warm-up would otherwise shut it out for good)."""
    exact = [total * share for share in shares]
    sizes = [int(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: sizes[i] - exact[i])
    for i in by_remainder[: total - sum(sizes)]:
        sizes[i] += 1
    floored = min(total, len(shares))  # these get one at least
    for i in range(floored):
        if not sizes[i]:
            donor = max(range(len(sizes)), key=lambda j: (sizes[j] > (j < floored), sizes[j]))
            sizes[donor] -= 1
            sizes[i] = 1
    return sizes
