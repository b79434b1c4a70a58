"""Every NVML call the agent makes: the reading it serves, the privilege ``nvml.h`` says it needs,
and the check that judges it (docs/health.md "What is read, and with what privilege").

The privileges are ``nvml.h``'s own words (the header of the R570-R580 drivers; DCGM ships a copy
as ``sdk/nvidia/nvml/dcgm_nvml.h``): "root" where the header says "Requires root/admin
permissions", "none" where it says nothing of the kind. ``tools/nvml_privileges.py`` measures what
a GPU answers with and without privileges, and ``tests/test_nvml_binding.py`` keeps this table
complete: every C function the backend calls is listed here.
"""

from __future__ import annotations

from typing import NamedTuple


class NvmlCall(NamedTuple):
    binding: str  # the nvidia-ml-py function the backend calls
    c_function: str  # the C symbol it looks up in libnvidia-ml.so.1
    reading: str  # the reading's name in GpuInfo.unread ("" for calls outside the per-GPU readings)
    privilege: str  # "none" | "root" (nvml.h)
    judged_by: str  # the check that judges it, or what uses it


CALLS: tuple[NvmlCall, ...] = (
    NvmlCall("nvmlInit", "nvmlInitWithFlags", "", "none", "the backend (NO_PERMISSION: no access to /dev/nvidia*)"),
    NvmlCall("nvmlDeviceGetCount", "nvmlDeviceGetCount_v2", "", "none", "gpu.present, gpu.count"),
    NvmlCall("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByIndex_v2", "", "none",
             "gpu.present (NO_PERMISSION: no access to that GPU's device file)"),
    NvmlCall("nvmlDeviceGetUUID", "nvmlDeviceGetUUID", "", "none", "gpu.present, labels"),
    NvmlCall("nvmlDeviceGetName", "nvmlDeviceGetName", "", "none", "gpu.present, baselines"),
    NvmlCall("nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v3", "", "none", "gpu.count, topology"),
    NvmlCall("nvmlSystemGetDriverVersion", "nvmlSystemGetDriverVersion", "", "none", "gpu.driver_cuda, labels"),
    NvmlCall("nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion", "", "none", "gpu.driver_cuda"),
    NvmlCall("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo", "memory", "none", "metrics, labels"),
    NvmlCall("nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetCudaComputeCapability", "compute_capability",
             "none", "labels"),
    NvmlCall("nvmlDeviceGetPersistenceMode", "nvmlDeviceGetPersistenceMode", "persistence_mode", "none",
             "gpu.persistence_mode (tuning)"),
    NvmlCall("nvmlDeviceSetPersistenceMode", "nvmlDeviceSetPersistenceMode", "", "root",
             "gpu-tune apply / revert (enforce only)"),
    NvmlCall("nvmlDeviceGetMigMode", "nvmlDeviceGetMigMode", "mig_mode", "none", "gpu.mig (tuning), gpu.nvlink"),
    NvmlCall("nvmlDeviceGetEccMode", "nvmlDeviceGetEccMode", "ecc_mode", "none", "gpu.memory"),
    NvmlCall("nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetTotalEccErrors", "ecc_uncorrected_volatile", "none",
             "gpu.memory"),
    NvmlCall("nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetRetiredPagesPendingStatus",
             "retired_pages_pending", "none", "gpu.memory (before Ampere)"),
    NvmlCall("nvmlDeviceGetRemappedRows", "nvmlDeviceGetRemappedRows", "remapped_rows", "none",
             "gpu.memory (Ampere and later; NOT_SUPPORTED with MIG on)"),
    NvmlCall("nvmlDeviceGetSramEccErrorStatus", "nvmlDeviceGetSramEccErrorStatus", "sram_ecc", "root", "gpu.memory"),
    NvmlCall("nvmlDeviceGetMemoryErrorCounter", "nvmlDeviceGetMemoryErrorCounter", "sram_ecc", "none",
             "gpu.memory (SRAM, where the status call is missing)"),
    NvmlCall("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperature", "temperature", "none", "gpu.thermal"),
    NvmlCall("nvmlDeviceGetPowerUsage", "nvmlDeviceGetPowerUsage", "power", "none", "metrics"),
    NvmlCall("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetUtilizationRates", "utilization", "none",
             "gpu.pcie (busy or idle)"),
    NvmlCall("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksEventReasons",
             "clock_event_reasons", "none", "gpu.thermal"),
    NvmlCall("nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
             "clock_event_reasons", "none", "gpu.thermal (drivers before the new name)"),
    NvmlCall("nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkGeneration", "pcie_link", "none",
             "gpu.pcie"),
    NvmlCall("nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkGeneration", "pcie_link", "none",
             "gpu.pcie (the top generation of this device in this system)"),
    NvmlCall("nvmlDeviceGetGpuMaxPcieLinkGeneration", "nvmlDeviceGetGpuMaxPcieLinkGeneration", "pcie_link",
             "none", "gpu.pcie (the GPU's own top generation, for the detail)"),
    NvmlCall("nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetCurrPcieLinkWidth", "pcie_link", "none", "gpu.pcie"),
    NvmlCall("nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkWidth", "pcie_link", "none", "gpu.pcie"),
    NvmlCall("nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetPcieReplayCounter", "pcie_replay_count", "none",
             "gpu.pcie_errors (warning)"),
    NvmlCall("nvmlDeviceGetClockInfo", "nvmlDeviceGetClockInfo", "sm_clock", "none", "gpu.thermal"),
    NvmlCall("nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetMaxClockInfo", "sm_clock", "none", "gpu.thermal"),
    NvmlCall("nvmlDeviceGetFieldValues", "nvmlDeviceGetFieldValues", "recovery_action", "none",
             "gpu.recovery (field 230; NOT_SUPPORTED per field before R550)"),
    NvmlCall("nvmlDeviceValidateInforom", "nvmlDeviceValidateInforom", "inforom", "none", "gpu.inforom (warning)"),
    NvmlCall("nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkState", "nvlink", "none", "gpu.nvlink"),
    NvmlCall("nvmlDeviceGetNvLinkErrorCounter", "nvmlDeviceGetNvLinkErrorCounter", "nvlink_error_counters", "none",
             "metrics (never judged)"),
    NvmlCall("nvmlDeviceGetP2PStatus", "nvmlDeviceGetP2PStatus", "nvlink_p2p", "none", "gpu.nvlink"),
    NvmlCall("nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetGpuFabricInfoV", "fabric", "none", "gpu.fabric"),
    NvmlCall("nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetGpuFabricInfo", "fabric", "none",
             "gpu.fabric (drivers without the versioned call)"),
    NvmlCall("nvmlEventSetCreate", "nvmlEventSetCreate", "xid_events", "none", "gpu.xid"),
    NvmlCall("nvmlDeviceRegisterEvents", "nvmlDeviceRegisterEvents", "xid_events", "none", "gpu.xid"),
    NvmlCall("nvmlEventSetWait", "nvmlEventSetWait_v2", "xid_events", "none", "gpu.xid"),
    NvmlCall("nvmlEventSetFree", "nvmlEventSetFree", "", "none", "the backend"),
    NvmlCall("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v3", "", "none",
             "gpu-tune probe (busy GPUs), apply"),
    NvmlCall("nvmlDeviceGetCpuAffinity", "nvmlDeviceGetCpuAffinity", "", "none", "topology"),
    NvmlCall("nvmlShutdown", "nvmlShutdown", "", "none", "the backend"),
    NvmlCall("nvmlErrorString", "nvmlErrorString", "", "none", "error texts"),
)

# reading -> the checks that judge it (what a missing reading leaves unjudged)
READING_CHECKS: dict[str, str] = {}
for _c in CALLS:
    if _c.reading:
        READING_CHECKS.setdefault(_c.reading, _c.judged_by.split(" (")[0])
ROOT_READINGS = frozenset(c.reading for c in CALLS if c.privilege == "root" and c.reading)
