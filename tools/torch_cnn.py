"""The probe's CNN in PyTorch eager, for the device-bound comparison of tools/gpu_proof.py.

    python tools/torch_cnn.py [--device gpu|cpu] [--batch-size 4096] [--seconds 3] [--data PATH]

Prints one JSON document. The network is the probe's (gpu_tune/workload/train.py):
Conv32(3x3)-pool-Conv64(3x3)-pool-Dense128-Dense10, 225,034 parameters, Adam, cross-entropy, in
plain PyTorch eager (no ``torch.compile``), with bfloat16 autocast on a GPU and float32 on a CPU.
The images (float32, 0..1) and labels live on the device; each step gathers its batch there from
a precomputed table of random indices, so no host input pipeline takes part. After a warm-up
(``--warmup-seconds``), training runs in chunks of steps, each chunk waited for, until
``--seconds`` have passed; images/s is over that window and, on a GPU, the mean NVML utilization
inside it is the GPU busy fraction (gpu_tune.workload.hostinfo.NvmlSampler, as the probe reports it).

Exit 0 with a result; 3 with ``"error_kind": "missing"`` when PyTorch cannot be imported here;
4 when a GPU was asked for and PyTorch sees none.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--batch-size", type=int, default=None, help="[default: 4096 on a GPU, 1024 on a CPU]")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed window")
    ap.add_argument("--warmup-seconds", type=float, default=1.0)
    ap.add_argument("--data", default=None, help="MNIST file (as the probe's --data)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    out: dict = {"ok": False, "framework": "pytorch", "mode": "eager", "device_kind": a.device}
    t_import = time.monotonic()
    try:
        import torch
        import torch.nn.functional as F
        from torch import nn
    except Exception as exc:  # not installed, or a broken install: a fact to report
        out.update(error_kind="missing", error=f"PyTorch is not importable here: {type(exc).__name__}: {exc}")
        print(json.dumps(out))
        return 3
    import numpy as np

    from gpu_tune.workload import data as mnist_data
    from gpu_tune.workload.hostinfo import NvmlSampler

    out["torch_import_seconds"] = round(time.monotonic() - t_import, 3)
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    if a.device == "gpu" and not torch.cuda.is_available():
        out.update(error_kind="device", error=f"PyTorch {torch.__version__} sees no GPU")
        print(json.dumps(out))
        return 4
    dev = torch.device("cuda" if a.device == "gpu" else "cpu")
    bs = a.batch_size or (4096 if a.device == "gpu" else 1024)
    bf16 = a.device == "gpu"
    out.update(batch_size=bs, precision="bfloat16 autocast" if bf16 else "float32",
               device=torch.cuda.get_device_name(0) if a.device == "gpu" else "CPU",
               threads=torch.get_num_threads())
    ds = mnist_data.load(a.data, seed=a.seed)
    out["data"] = ds.summary()
    torch.manual_seed(a.seed)
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(1600, 128), nn.ReLU(), nn.Linear(128, 10),
    ).to(dev)
    out["parameters"] = int(sum(p.numel() for p in model.parameters()))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.from_numpy(np.asarray(ds.x_train, np.float32) / np.float32(255.0)).unsqueeze(1).to(dev)
    y = torch.from_numpy(np.asarray(ds.y_train, np.int64)).to(dev)
    gen = torch.Generator(device="cpu").manual_seed(a.seed)
    table = torch.randint(0, int(x.shape[0]), (64, bs), generator=gen).to(dev)

    def sync() -> None:
        if a.device == "gpu":
            torch.cuda.synchronize()

    k = 0

    def steps(n: int) -> torch.Tensor:
        nonlocal k
        loss = None
        for _ in range(n):
            idx = table[k % table.shape[0]]
            k += 1
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return loss

    t0 = time.monotonic()
    steps(3)
    sync()
    out["first_steps_seconds"] = round(time.monotonic() - t0, 3)
    t1 = time.perf_counter()
    while time.perf_counter() - t1 < a.warmup_seconds:
        steps(5)
        sync()
    # size a chunk to ~0.1 s so that the wait after each chunk is a small share of the window
    t2 = time.perf_counter()
    steps(5)
    sync()
    per_step = max((time.perf_counter() - t2) / 5, 1e-5)
    chunk = max(1, min(500, int(0.1 / per_step)))
    sampler = NvmlSampler(interval_s=0.1)
    if a.device == "gpu":
        sampler.start()
    n_steps = 0
    start_m, start = time.monotonic(), time.perf_counter()
    while n_steps == 0 or time.perf_counter() - start < a.seconds:
        loss = steps(chunk)
        sync()
        n_steps += chunk
    elapsed = time.perf_counter() - start
    window = (start_m, start_m + elapsed)
    busy = sampler.window(window) if a.device == "gpu" else {"gpu_busy_fraction": None, "gpu_samples": 0}
    sampler.stop()
    out.update(ok=True, steps=n_steps, steps_per_chunk=chunk, seconds=round(elapsed, 3),
               images_per_second=round(n_steps * bs / elapsed, 1), step_ms=round(elapsed / n_steps * 1000, 3),
               final_loss=round(float(loss.item()), 4), **busy)
    if a.device == "gpu":
        out["max_memory_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
