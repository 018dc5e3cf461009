#!/usr/bin/env python3
"""Reference TensorBoard event file, written by `torch.utils.tensorboard.SummaryWriter`.

    .venv-py/bin/python scripts/python/make_tensorboard_fixture.py [OUT_DIR]
        # OUT_DIR defaults to trainer/tests/fixtures/tensorboard (the committed fixture)

Writes `summary_writer.tfevents` (the event file SummaryWriter wrote, renamed) and
`expected.json` (every scalar given to `add_scalar`: tag, step, wall time and the value as the
f32 the file stores). The clock is fixed (`time.time` patched) so that the header event's wall
time, and so the file, is the same on every run. `cargo test` never runs this: the outputs are
committed, and trainer/tests/tensorboard.rs checks that the trainer's reader reads these
records and its writer writes the same bytes for them.
"""
import argparse
import glob
import json
import math
import os
import shutil
import struct
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "trainer", "tests", "fixtures", "tensorboard")
START = 1_764_288_000.5  # the fixed clock

# (tag, step, value): the trainer's tags, values that f32 does not hold exactly (0.1), zero
# (a oneof member is written even when zero), a negative, a NaN (a step the loss scaler
# skipped), a huge step, and a second event at one step.
SCALARS = [
    ("train/loss", 1, 4.1589),
    ("train/learning_rate", 1, 0.1),
    ("train/grad_norm", 1, 0.0),
    ("train/tokens_per_s", 1, 123456.789),
    ("train/mfu", 1, 0.0123),
    ("train/loss", 2, 3.25),
    ("train/grad_norm", 2, float("nan")),
    ("eval/loss", 2, -1.5),
    ("eval/accuracy", 2, 0.75),
    ("train/loss", 3_000_000_000, 1e-30),
]


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=DEFAULT_OUT)
    out = ap.parse_args().out
    time.time = lambda: START
    from torch.utils.tensorboard import SummaryWriter
    import tensorboard
    import torch

    expected = []
    with tempfile.TemporaryDirectory() as tmp:
        w = SummaryWriter(log_dir=tmp)
        for i, (tag, step, value) in enumerate(SCALARS):
            wall = START + 0.25 * (i + 1)
            w.add_scalar(tag, value, step, walltime=wall)
            v = f32(value)
            expected.append(
                {"tag": tag, "step": step, "wall_time": wall, "value": None if math.isnan(v) else v}
            )
        w.close()
        (path,) = glob.glob(os.path.join(tmp, "events.out.tfevents.*"))
        os.makedirs(out, exist_ok=True)
        shutil.copyfile(path, os.path.join(out, "summary_writer.tfevents"))
    doc = {
        "written_by": f"torch {torch.__version__} SummaryWriter, tensorboard {tensorboard.__version__}",
        "header_wall_time": START,
        "scalars": expected,
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
