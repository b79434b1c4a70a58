"""The readiness probe workload: MNIST on a small CNN, run in its own process.

This package is the only place TensorFlow is imported (``gpu_tune.workload.train``). The data loaders
(``gpu_tune.workload.data``) and the in-process host facts (``gpu_tune.workload.hostinfo``) need NumPy only.
"""

# Bumped whenever the probe's fixed work or its numerics change: results (and fingerprints) of
# different probe versions are not comparable.
PROBE_VERSION = "2"

# What the probe says where its extras are missing (TensorFlow, and NumPy with it): one line naming them.
NOT_INSTALLED = ("TensorFlow is not installed in this environment: install `gpu-tune[gpu]` (GPU) "
                 "or `gpu-tune[probe]` (CPU)")
