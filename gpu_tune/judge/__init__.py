"""Judge: the verdicts. Readiness from the latest facts (:mod:`~gpu_tune.judge.readiness`), the
MNIST probe that proves a GPU computes right and fast (:mod:`~gpu_tune.judge.probe`), and what a
profile gains on this node (:mod:`~gpu_tune.judge.gain`)."""
