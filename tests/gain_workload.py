"""A stand-in for the probe workload in `gpu-tune gain` machinery tests (the real one is in the slow
test): it reports what the process saw, so a test can check which side ran where.

Reads ``GAIN_TEST_ROOT``/proc/sys/vm/swappiness (the fixture host's value at the moment it runs),
appends one JSON line per run to ``GAIN_TEST_LOG`` (side seen, CPU affinity, LD_PRELOAD), sleeps
``GAIN_TEST_SLEEP`` seconds, and reports images/s ``GAIN_TEST_TUNED_IPS`` when the host reads
tuned (swappiness 0) else ``GAIN_TEST_UNTUNED_IPS``, each with a small per-run wobble.
"""

import json
import os
import random
import sys
import time


def active_families(root: str) -> list[str]:
    """The setting families this run sees applied: on the fixture host (sysctls, THP, governor)
    and in its own process (NUMA memory binding, the jemalloc preload)."""
    def read(rel: str) -> str:
        try:
            with open(os.path.join(root, rel), encoding="ascii") as fh:
                return fh.read()
        except OSError:
            return ""

    out = []
    if read("proc/sys/vm/swappiness").strip() == "0":
        out.append("sysctl")
    if read("sys/kernel/mm/transparent_hugepage/enabled").strip() in ("always", "[always] madvise never"):
        out.append("thp")
    if read("sys/devices/system/cpu/cpu0/cpufreq/scaling_governor").strip() == "performance":
        out.append("cpu")
    try:
        with open("/proc/self/numa_maps", encoding="ascii") as fh:
            if " bind:" in fh.read():
                out.append("numa")
    except OSError:
        pass
    if "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        out.append("allocator")
    return out


def main() -> int:
    root = os.environ["GAIN_TEST_ROOT"]
    with open(os.path.join(root, "proc/sys/vm/swappiness"), encoding="ascii") as fh:
        swappiness = fh.read().strip()
    tuned = swappiness == "0"
    n = 0
    log = os.environ.get("GAIN_TEST_LOG")
    if log:
        if os.path.exists(log):
            with open(log, encoding="utf-8") as fh:
                n = sum(1 for _ in fh)
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"pid": os.getpid(), "swappiness": swappiness, "affinity": sorted(os.sched_getaffinity(0)),
                                 "families": active_families(root),
                                 "ld_preload": os.environ.get("LD_PRELOAD", ""), "argv": sys.argv[1:]}) + "\n")
    time.sleep(float(os.environ.get("GAIN_TEST_SLEEP", "0")))
    effects = json.loads(os.environ.get("GAIN_TEST_EFFECTS") or "null")
    if effects is None:
        ips = float(os.environ["GAIN_TEST_TUNED_IPS" if tuned else "GAIN_TEST_UNTUNED_IPS"])
    else:  # per setting family: each family seen active multiplies the untuned images/s
        ips = float(os.environ["GAIN_TEST_UNTUNED_IPS"])
        for fam in active_families(root):
            ips *= float(effects.get(fam, 1.0))
    ips *= 1 + random.Random(n).uniform(-0.008, 0.008)  # a wobble of at most 0.8 %, the same for run n
    p50 = 256 / ips
    doc = {"ok": True, "regimes": {"launch_bound": {
        "images_per_second": ips, "steps": 100,
        "step_seconds": {"samples": 100, "p50": p50, "p99": p50 * 1.2, "p99_over_p50": 1.2}}},
        "host": {"cpu_affinity": ",".join(map(str, sorted(os.sched_getaffinity(0)))), "mems_allowed": "0",
                 "jemalloc_mapped": "jemalloc" in os.environ.get("LD_PRELOAD", ""),
                 "ld_preload": os.environ.get("LD_PRELOAD", "")}}
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
