"""The cluster side: what the Node should carry (:mod:`~gpu_tune.cluster.labels`), publishing it
(:mod:`~gpu_tune.cluster.publisher`), and the fleet as the agents published it
(:mod:`~gpu_tune.cluster.fleet`)."""
