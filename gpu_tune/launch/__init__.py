"""Start a workload bound to its GPU's NUMA node with the profile's allocator
(``gpu-tune run``, and the probe's own process)."""
