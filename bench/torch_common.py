"""What the PyTorch reference benches share: the f32 matmul ceiling, the optimiser and the peak of
live tensor bytes during one step. Torch is passed in or imported where used, so that a bench can measure its
memory before torch loads.
"""
import json
import math
import os
import threading
import time

def matmul_ceiling(torch):
    """FLOP/s of the best of ten f32 1024^3 matmuls (after one warm-up): the machine's ceiling."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = math.inf
    for i in range(11):
        s = time.perf_counter()
        a @ b
        if i:
            best = min(best, time.perf_counter() - s)
    return 2 * 1024**3 / best


def adamw(torch, model, betas):
    """AdamW at lr 1e-3 with weight decay 0.1 on the matrices (parameters of 2+ dimensions) and
    none on the rest (biases, norm scales)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=betas,
    )


def peak_step_bytes(step):
    """Highest sum of live tensor bytes during `step()`, from the profiler's memory timeline
    (every tensor the step touches: weights, gradients, optimiser state, activations)."""
    import tempfile
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step()
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = os.path.join(d, "timeline.json")
        prof.export_memory_timeline(path, device="cpu")
        _, sizes = json.load(open(path))
    return max(sum(s) for s in sizes)


def status_mib(key):
    """VmRSS / VmHWM of this process from /proc/self/status, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return None


PERIOD_S = 0.002


class AnonPeak:
    """A thread reading RssAnon every PERIOD_S and keeping the highest value (MiB) seen since it
    started or since `reset()` (trainer/benches/support/memory.rs on our side)."""

    def __init__(self):
        self.peak = status_mib("RssAnon") or 0.0
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, status_mib("RssAnon") or 0.0)
            time.sleep(PERIOD_S)

    def read(self):
        self.peak = max(self.peak, status_mib("RssAnon") or 0.0)
        return self.peak

    def reset(self):
        self.peak = status_mib("RssAnon") or 0.0

    def close(self):
        self.stop = True
        self.thread.join()
