"""Tune: audit -> plan -> apply -> verify -> revert.

Profiles (:mod:`~gpu_tune.tune.policy`) say what is wanted; one knob per setting family
(:mod:`~gpu_tune.tune.knobs`) reads, plans, writes and verifies it; the engine
(:mod:`~gpu_tune.tune.engine`) runs them, recording every original in the journal
(:mod:`~gpu_tune.tune.journal`) before the first write."""
