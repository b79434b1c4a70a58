"""``gpu-tune gain``: the profile's effect on the probe's throughput here, measured untuned
against tuned (:mod:`~gpu_tune.judge.gain.measure`) and judged with an interval
(:mod:`~gpu_tune.judge.gain.stats`)."""
