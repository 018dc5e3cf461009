#!/usr/bin/env python3
"""Reference losses for custom objectives (trainer/tests/objective.rs), made with torch.

    .venv-py/bin/python scripts/python/make_objective_fixtures.py [OUT_DIR]
        # OUT_DIR defaults to trainer/tests/fixtures/objective (the committed fixture)

Reads the `llama` case of trainer/tests/fixtures/llama (made by make_llama_fixtures.py):
transformers' logits `[B, T, V]` of its model on its batch, and its labels (-100 = ignored).
Writes `label_smoothing.json`: for each epsilon, `torch.nn.CrossEntropyLoss(ignore_index=-100,
label_smoothing=eps)` of the shifted logits and labels (position t predicts labels[t + 1], as
transformers' causal-LM loss), in f32 as torch computes it, and the same in f64 (what the f32
value rounds). `cargo test` never runs this: the output is committed.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASE = os.path.join(ROOT, "trainer", "tests", "fixtures", "llama", "llama")
DEFAULT_OUT = os.path.join(ROOT, "trainer", "tests", "fixtures", "objective")
EPSILONS = [0.0, 0.1]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    t = load_file(os.path.join(CASE, "expected.safetensors"))
    logits, labels = t["logits"], t["labels"]
    v = logits.shape[-1]
    shifted = logits[:, :-1, :].reshape(-1, v)
    targets = labels[:, 1:].reshape(-1)
    cases = []
    for eps in EPSILONS:
        f = torch.nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=eps)
        loss32 = f(shifted, targets)
        loss64 = f(shifted.double(), targets)
        cases.append(dict(epsilon=eps, loss=float(loss32), loss_f64=float(loss64)))
    # eps = 0 is transformers' own loss of the case (its fixture's `loss`).
    if abs(cases[0]["loss"] - float(t["loss"])) > 1e-6 * float(t["loss"]):
        raise SystemExit(f"eps 0: {cases[0]['loss']} is not the fixture's loss {float(t['loss'])}")
    doc = dict(
        made_by="scripts/python/make_objective_fixtures.py",
        source="trainer/tests/fixtures/llama/llama/expected.safetensors (logits, labels)",
        torch=torch.__version__,
        vocab=v,
        counted=int((targets != -100).sum()),
        cases=cases,
    )
    with open(os.path.join(out, "label_smoothing.json"), "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
