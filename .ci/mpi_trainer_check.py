#!/usr/bin/env python3
"""Compares the step losses and gradient norms of two trainer runs' metrics.jsonl files.

Usage: mpi_trainer_check.py A/metrics.jsonl B/metrics.jsonl REL_TOL
Exits non-zero (printing the first difference) unless both runs logged the same steps and every
loss and grad_norm agrees within REL_TOL (relative).
"""
import json
import sys


def steps(path):
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r and "grad_norm" in r:
                out[r["step"]] = (r["loss"], r["grad_norm"], r["tokens_seen"])
    return out


a, b, tol = steps(sys.argv[1]), steps(sys.argv[2]), float(sys.argv[3])
if sorted(a) != sorted(b) or not a:
    sys.exit(f"different steps: {sorted(a)} vs {sorted(b)}")
worst = 0.0
for s in sorted(a):
    (la, ga, ta), (lb, gb, tb) = a[s], b[s]
    if ta != tb:
        sys.exit(f"step {s}: tokens_seen {ta} vs {tb}")
    for name, x, y in (("loss", la, lb), ("grad_norm", ga, gb)):
        rel = abs(x - y) / max(abs(x), 1e-6)
        worst = max(worst, rel)
        if not rel <= tol:
            sys.exit(f"step {s}: {name} {x} vs {y} (relative {rel:.2e} > {tol})")
print(f"{len(a)} steps agree: worst relative difference {worst:.2e} (tolerance {tol})")
