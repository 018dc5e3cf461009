#!/usr/bin/env python3
"""Reads a trainer run's TensorBoard event file with TensorBoard's own reader and compares
every scalar with the run's metrics.jsonl.

    .venv-py/bin/python scripts/python/check_tensorboard.py RUN_DIR

TensorBoard's `EventAccumulator` (which checks every record's CRCs) loads RUN_DIR; each record
of metrics.jsonl must be there under its tag (see `trainer::tensorboard::scalars_of`) at its
optimizer step with its value as f32, each (tag, step) exactly once (a resumed run must not
repeat steps), and nothing else. Exits non-zero naming the first difference. Not run by
`cargo test` (trainer/tests/tensorboard.rs checks the same against a committed fixture).
"""
import json
import math
import re
import struct
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def expected(run_dir):
    """(tag, step) -> value for every record of metrics.jsonl."""
    want = {}

    def put(tag, step, value):
        key = (tag, step)
        if key in want:
            sys.exit(f"metrics.jsonl: {tag} at step {step} twice")
        want[key] = math.nan if value is None else f32(value)

    with open(f"{run_dir}/metrics.jsonl") as f:
        for line in f:
            r = json.loads(line)
            s = r["step"]
            if r["kind"] == "step":
                put("train/loss", s, r["loss"])
                put("train/learning_rate", s, r["lr"])
                put("train/grad_norm", s, r["grad_norm"])
                put("train/tokens_per_s", s, r["tokens_per_sec"])
                put("train/mfu", s, r.get("mfu", 0.0))
                if r.get("loss_scale") is not None:
                    put("train/loss_scale", s, r["loss_scale"])
            else:
                put("eval/loss", s, r["val_loss"])
                put("eval/train_loss", s, r["train_loss"])
                if r.get("score") is not None:
                    name = re.sub(r"[^-/\w.]", "_", r["score_name"])
                    put(f"eval/{name}", s, r["score"])
    return want


def main():
    run_dir = sys.argv[1]
    want = expected(run_dir)
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    got = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            if (tag, e.step) in got:
                sys.exit(f"{tag}: step {e.step} twice in the event files")
            got[(tag, e.step)] = e.value
    if set(got) != set(want):
        sys.exit(
            f"only in the events: {sorted(set(got) - set(want))[:5]}; "
            f"only in metrics.jsonl: {sorted(set(want) - set(got))[:5]}"
        )
    for key, w in want.items():
        g = got[key]
        same = (math.isnan(g) and math.isnan(w)) or g == w
        if not same:
            sys.exit(f"{key[0]} at step {key[1]}: events {g!r}, metrics.jsonl {w!r}")
    steps = sorted({s for t, s in want if t == "train/loss"})
    print(f"{run_dir}: {len(want)} scalars, {len(acc.Tags()['scalars'])} tags, steps "
          f"{steps[0] if steps else '-'}..{steps[-1] if steps else '-'}: all equal to metrics.jsonl")


if __name__ == "__main__":
    main()
