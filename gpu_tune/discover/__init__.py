"""Discover: what the node is. NUMA nodes, CPUs, memory, GPUs, NICs and their interrupts,
read from the kernel's own files and the GPU backend (:func:`gpu_tune.discover.topology.discover`)."""
