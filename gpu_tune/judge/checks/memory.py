"""GPU memory faults: HBM (ECC, row remapping) and on-chip SRAM.

``gpu.memory`` (fatal) fails a GPU with uncorrected volatile ECC errors (since the driver loaded:
cleared by a GPU reset), a page retirement or row remapping pending (done at the next reset), a
row remapping that failed (no spare row left: replace the GPU), at least
:data:`UNCORRECTABLE_ROWS_LIMIT` rows remapped for uncorrectable errors, or uncorrected SRAM errors
(or the driver's SRAM threshold exceeded). Correctable counts are metrics only. Passes again by
itself when the reading clears (a pending remap done by a reset).
"""

from __future__ import annotations

from gpu_tune.judge.checks.base import Check, Facts, Family, answering, gpu_label, listed, per_gpu
from gpu_tune.judge.checks.readings import not_read_note

# DCGM's rule (its health watch): 512 rows remapped for uncorrectable errors exhaust a bank's spares.
UNCORRECTABLE_ROWS_LIMIT = 512


def memory_problems(g) -> list[str]:
    out = []
    ecc = g.ecc_uncorrected_volatile
    if isinstance(ecc, int) and ecc > 0:
        out.append(f"{ecc} uncorrected ECC error(s) since the driver loaded: drain the node and reset the GPU")
    rr = g.remapped_rows
    if rr is not None:
        if rr.failure:
            out.append("row remapping failed (no spare row left): drain the node and replace the GPU")
        if rr.pending:
            out.append("a row remapping is pending: drain the node and reset the GPU to complete it")
        if isinstance(rr.uncorrectable, int) and rr.uncorrectable >= UNCORRECTABLE_ROWS_LIMIT:
            out.append(f"{rr.uncorrectable} rows remapped for uncorrectable errors (limit "
                       f"{UNCORRECTABLE_ROWS_LIMIT}): drain the node and replace the GPU")
    elif g.retired_pages_pending:
        out.append("a page retirement is pending: drain the node and reset the GPU to complete it")
    sram = g.sram_ecc
    if sram is not None:
        if isinstance(sram.uncorrected, int) and sram.uncorrected > 0:
            out.append(f"{sram.uncorrected} uncorrected SRAM ECC error(s): drain the node and reset the GPU; "
                       "replace it if they recur")
        if sram.threshold_exceeded:
            out.append("the SRAM ECC error threshold is exceeded: drain the node and replace the GPU")
    return out


class Memory(Family):
    name = "memory"
    category = "memory"
    source = "NVML"
    reads = ("nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE), nvmlDeviceGetRetiredPagesPendingStatus, "
             "nvmlDeviceGetRemappedRows (correctable, uncorrectable, pending, failure), "
             "nvmlDeviceGetSramEccErrorStatus / nvmlDeviceGetMemoryErrorCounter(SRAM)")
    thresholds = (f"uncorrected volatile ECC 0; no remap pending or failed; uncorrectable remapped rows < "
                  f"{UNCORRECTABLE_ROWS_LIMIT}; uncorrected SRAM 0 and its threshold not exceeded")
    remedy = "drain the node; reset the GPU (pending remap, volatile ECC); replace it (remap failure, rows, SRAM)"
    checks = ("gpu.memory",)

    def evaluate(self, facts: Facts) -> list[Check]:
        gpus = answering(facts.gpus)
        if not gpus:
            return []
        bad = {g.index: memory_problems(g) for g in gpus}
        bad = {i: p for i, p in bad.items() if p}
        per = per_gpu(gpus, bad)
        note = not_read_note(gpus, "ecc_uncorrected_volatile", "remapped_rows", "retired_pages_pending", "sram_ecc")
        if not bad:
            return [self.check("gpu.memory", True, f"no uncorrected memory error on {len(gpus)} GPU(s){note}",
                               gpus=per)]
        by_index = {g.index: g for g in gpus}
        texts = [f"{gpu_label(by_index[i])}: {'; '.join(p)}" for i, p in sorted(bad.items())]
        short = [f"GPU {i}: " + "; ".join(x.split(": drain")[0] for x in p) for i, p in sorted(bad.items())]
        return [self.check("gpu.memory", False, listed(texts) + note, listed(short, 3), gpus=per)]
