"""``gpu-tune serve``: the agent. The loop that runs the flow on an interval, the read-only HTTP API
and the Prometheus exposition it serves from each pass's snapshot."""
