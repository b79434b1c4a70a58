"""The steps of tools/gpu_proof.py, one module per group, and its report.

common       the steps, their expected seconds and limits, small functions
runner       a step's commands, each bounded by its deadline; processes it leaves behind
hosts        the real host on a GPU, fixture trees on a CPU; snapshots for the byte-for-byte check
host_steps   environment, topology, health, tuning
probe_steps  probe, fingerprint, verdict, gain
serve        the agent
torch_step   PyTorch eager against the probe's device-bound figure
checkout     the commit and the commands' environment
report       merging reports, the Markdown

tools/gpu_proof.py is the entry: its command line, the run of every step in a process of its own.
"""
