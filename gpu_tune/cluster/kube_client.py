"""The kubernetes client's packages, loaded part by part: what :mod:`gpu_tune.cluster.api` calls
(``ApiClient``, ``Configuration``, the exceptions, the in-cluster or kubeconfig loader), not the
whole client.

``import kubernetes`` runs the package's ``__init__``, which imports the dynamic client (and
``jsonschema``), watch, stream (websocket), utils, leader election, the informers and the
kubeconfig loader (``requests``, ``oauthlib``): about 11.5 MiB resident for the agent's life, of
which it uses the ``ApiClient``, its configuration and, out of a cluster, the kubeconfig loader
(benchmarks/bench_rss.py). :func:`modules` puts the packages ``kubernetes``, ``kubernetes.client``,
``kubernetes.client.models``, ``kubernetes.config`` and ``kubernetes.utils`` in ``sys.modules``
without running their ``__init__`` (:mod:`gpu_tune.partial_import`; their submodules import as
usual from the package's folder), then imports the few modules named above.

Nothing is lost: a name of a package's ``__init__`` that is not loaded yet (``client.CoreV1Api``,
``client.models.V1Node``, ``config.load_kube_config``, ``from kubernetes import watch``) loads on
first use, the submodule or the whole ``__init__`` then, as a plain import would have. Where
``kubernetes`` was imported whole before (a test, a tool), that is what is used.
"""

from __future__ import annotations

import sys
from typing import Any

from gpu_tune import partial_import

PACKAGES = ("kubernetes", "kubernetes.client", "kubernetes.client.models", "kubernetes.config", "kubernetes.utils")
# what gpu_tune.cluster.api names on the packages themselves
NAMES = {
    "kubernetes.client.ApiClient": ("kubernetes.client.api_client", "ApiClient"),
    "kubernetes.client.Configuration": ("kubernetes.client.configuration", "Configuration"),
    "kubernetes.config.ConfigException": ("kubernetes.config.config_exception", "ConfigException"),
    "kubernetes.config.load_incluster_config": ("kubernetes.config.incluster_config", "load_incluster_config"),
}


def modules() -> tuple[Any, Any]:
    """(``kubernetes.client``, ``kubernetes.config``), loaded part by part (this module's doc)."""
    try:
        partial_import.install(PACKAGES, NAMES)
    except ImportError:  # not installed (raised again below), or a client laid out otherwise: imported whole
        import kubernetes.client
        import kubernetes.config  # noqa: F401
    return sys.modules["kubernetes.client"], sys.modules["kubernetes.config"]
