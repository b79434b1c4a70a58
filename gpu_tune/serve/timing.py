"""When the agent's next pass starts (:func:`pass_wait`), apart from the loop that waits for it."""

from __future__ import annotations

import random


def pass_wait(rng: random.Random, interval: float, jitter: float, *, after_first_publish: bool = False) -> float:
    """Seconds from the end of one pass to the start of the next: ``interval`` +- ``jitter``
    (a fraction); after the pass that made this agent's first publish (``after_first_publish``),
    anything from 0 to ``interval``, uniformly. Agents a rollout started together (and whose first
    publish waited for probes of about the same length) would otherwise keep passing together: +-10 %
    a pass spreads them by only 3.5 s (at a 60 s interval) times the square root of the passes
    made, so a change every node sees at once (a label set on every Node, a shared dependency
    failing) would reach the API server from the whole fleet within a few seconds. The uniform
    wait spreads the fleet's passes over the interval from then on, at no cost (it never waits
    longer). benchmarks/bench_fleet_scale.py replays a fleet's passes with this function
    (docs/fleet.md, "Cost")."""
    if after_first_publish:
        return rng.uniform(0.0, interval)
    return interval * (1 + rng.uniform(-jitter, jitter))
