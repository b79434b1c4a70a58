"""gpu-tune: tune GPU nodes, label their topology, prove they are ready."""

__version__ = "0.1.0"
