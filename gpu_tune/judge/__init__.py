"""Judge: the verdicts. Readiness from the latest facts (:mod:`~gpu_tune.judge.readiness`), the
MNIST probe that proves a GPU computes right and fast (:mod:`~gpu_tune.judge.probe`), what a
profile gains on this node (:mod:`~gpu_tune.judge.gain`), and how many nodes the fleet may have out of
service at once, which every scheduler's adapter asks before it takes a node out
(:mod:`~gpu_tune.judge.fleet_limit`)."""
