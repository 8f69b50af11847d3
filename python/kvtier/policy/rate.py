"""Write budgets: how many bytes a tier may write per second.

Process: the engine's scheduler (where the disk and remote tiers' indexes live).

Who calls: the disk and remote tiers' ``admit`` (the manager's cascade, under
its lock, once per offered block). Never blocks: a refusal drops the offer.
"""

from __future__ import annotations

import time

from kvtier.errors import InvalidArgument


class TokenBucket:
    """``rate`` bytes per second, bursts of one second's worth; ``None``: unlimited."""

    def __init__(self, rate: float | None) -> None:
        if rate is not None and not rate > 0:
            raise InvalidArgument(f"write budget must be > 0 bytes/s, got {rate}")
        self.rate = rate
        self.tokens = rate or 0.0
        self.t = time.monotonic()

    def take(self, n: int) -> bool:
        """True, and ``n`` bytes spent, when the budget has them now."""
        if self.rate is None:
            return True
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.t) * self.rate)
        self.t = now
        if self.tokens < n:
            return False
        self.tokens -= n
        return True
