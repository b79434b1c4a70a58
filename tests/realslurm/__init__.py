"""realslurm: a real Slurm for the test suite, from Debian's packages (22.05 in bookworm).

munged, slurmctld and slurmd run as plain processes on 127.0.0.1, with their own ports, key,
socket, state and spool folders in one temporary folder, and slurmd in a mount namespace where
that folder's configuration is ``/etc/slurm`` (:mod:`~tests.realslurm.cluster`). One per test run
(fixture ``slurm``, :mod:`~tests.realslurm.plugin`), shared by the tests that need it; the
cleanup is the real-Kubernetes harness's (:mod:`tests.realkube.cleanup`): a ledger written before
anything is made, a cgroup that holds every process, a janitor for runs killed outright.

Packages: ``munge``, ``slurmctld``, ``slurmd``, ``slurm-client`` (``make slurm-tools``).
"""
