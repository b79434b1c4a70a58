"""``gpu.driver_cuda``: the CUDA version the NVIDIA driver supports (NVML) is at least the one the
probe's TensorFlow was built for. Listed when the node has NVIDIA GPUs; a CPU-only or missing
TensorFlow, or a version that cannot be read, is ok with the reason in the detail."""

from __future__ import annotations

from gpu_tune.judge.checks.base import Check, Facts, Family


class Driver(Family):
    name = "driver"
    category = "driver"
    source = "NVML (nvmlSystemGetCudaDriverVersion) and the probe's TensorFlow build (read as text)"
    reads = "the driver's CUDA version against the CUDA version the probe's framework was built for"
    thresholds = "driver CUDA >= the probe's CUDA"
    remedy = "upgrade the driver, or use a probe framework built for the driver's CUDA"
    checks = ("gpu.driver_cuda",)

    def evaluate(self, facts: Facts) -> list[Check]:
        if facts.errors.get("gpus"):
            return []
        c = self.driver_cuda(facts.topology, list(facts.gpus))
        return [c] if c is not None else []

    def driver_cuda(self, topology, gpus) -> Check | None:
        from gpu_tune.gpu.cuda import cuda_major_minor

        name = "gpu.driver_cuda"
        topo = topology or {}
        driver = topo.get("cuda_driver_version")
        if "probe_runtime" not in topo or (driver is None and not gpus and not topo.get("gpus")):
            return None  # no facts (no topology yet), or no NVIDIA GPU
        rt = topo.get("probe_runtime") or {}
        fw = rt.get("framework") or "tensorflow"
        if not rt.get("found"):
            return self.check(name, True, f"not compared: the probe's {fw} is not installed"
                              + (f" (driver supports CUDA {driver})" if driver else ""))
        if rt.get("error"):
            return self.check(name, True, f"not compared: the probe's {fw} build is unknown ({rt['error']})")
        if not rt.get("is_cuda_build"):
            return self.check(name, True, f"not compared: the probe's {fw} is a CPU-only build (it cannot use the "
                              f"GPUs; install a CUDA build, e.g. tensorflow[and-cuda])"
                              + (f"; driver supports CUDA {driver}" if driver else ""))
        built = rt.get("cuda_version")
        have, need = cuda_major_minor(driver), cuda_major_minor(built)
        if driver is None:
            return self.check(name, True, f"not compared: the driver's CUDA version is unknown (the probe's {fw} "
                              f"was built for CUDA {built})")
        if have is None or need is None:
            return self.check(name, True, f"not compared: cannot read CUDA versions (driver {driver!r}, {fw} {built!r})")
        if have < need:
            return self.check(name, False, f"the NVIDIA driver supports CUDA {driver}, older than CUDA {built} the "
                              f"probe's {fw} was built for: upgrade the driver to one that supports CUDA "
                              f"{need[0]}.{need[1]} or newer, or use a {fw} built for CUDA {driver} or older")
        return self.check(name, True, f"the driver supports CUDA {driver}, the probe's {fw} was built for CUDA {built}")
