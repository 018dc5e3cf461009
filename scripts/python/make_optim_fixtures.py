#!/usr/bin/env python3
"""Reference updates of `torch.optim.SGD` for trainer/tests/optimizer.rs, made with torch.

    /work/venv-py/bin/python scripts/python/make_optim_fixtures.py [OUT_DIR]
        # OUT_DIR defaults to trainer/tests/fixtures/optim (the committed fixture)

Two f32 parameters (`w` [2, 3] and `b` [3]) from a seeded generator, and a seeded gradient of
each for each of STEPS steps, each step at its own learning rate (as the trainer's schedule
sets `lr` every step). For each case (momentum, dampening, nesterov, weight_decay),
`torch.optim.SGD` (single-tensor, foreach=False, on the CPU) applies the steps, each with
`p.grad` set to the step's gradient; `sgd.json` records the inputs, the parameters after
every step and the final `momentum_buffer` of each parameter (null without momentum), each
f32 value as its exact decimal. `cargo test` never runs this: the output is committed.
"""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "trainer", "tests", "fixtures", "optim")
STEPS = 4
LRS = [0.1, 0.05, 0.2, 0.01]
SHAPES = {"b": [3], "w": [2, 3]}
CASES = [
    {"momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0},
    {"momentum": 0.9, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0},
    {"momentum": 0.9, "dampening": 0.1, "nesterov": False, "weight_decay": 0.01},
    {"momentum": 0.8, "dampening": 0.0, "nesterov": True, "weight_decay": 0.05},
]


def values(t):
    """An f32 tensor's values, flattened, as Python floats (exact: an f32 is an f64)."""
    return [float(x) for x in t.detach().reshape(-1).tolist()]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=g, dtype=torch.float32) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=g, dtype=torch.float32) for n, s in SHAPES.items()} for _ in range(STEPS)]
    cases = []
    for case in CASES:
        params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
        opt = torch.optim.SGD(list(params.values()), lr=LRS[0], foreach=False, **case)
        after = []
        for step in range(STEPS):
            for group in opt.param_groups:
                group["lr"] = LRS[step]
            for n, p in params.items():
                p.grad = grads[step][n].clone()
            opt.step()
            after.append({n: values(p) for n, p in params.items()})
        buffers = {}
        for n, p in params.items():
            buf = opt.state[p].get("momentum_buffer")
            buffers[n] = None if buf is None else values(buf)
        cases.append({**case, "params_after": after, "momentum_buffer": buffers})
    fixture = {
        "torch": torch.__version__,
        "shapes": SHAPES,
        "lrs": LRS,
        "init": {n: values(t) for n, t in init.items()},
        "grads": [{n: values(t) for n, t in step.items()} for step in grads],
        "cases": cases,
    }
    with open(os.path.join(out, "sgd.json"), "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
