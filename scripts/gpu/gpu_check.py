#!/usr/bin/env python3
"""Helpers of scripts/gpu/run.sh (standard library only: they run on this CPU machine too).

    gpu_check.py make-data DIR VOCAB TOKENS    random nanoGPT train.bin / val.bin (u16) ids < VOCAB
    gpu_check.py losses A B TOL                compare two runs' step losses (metrics.jsonl)
    gpu_check.py ours CASE RUN_DIR MEM_FILE WARMUP   a trainer run's bench result (JSON line)
    gpu_check.py torch CASE JSON_FILE MEM_FILE       a PyTorch bench result (JSON line)
    gpu_check.py table RESULTS                 the one markdown table (exit 1 if a check failed)
    gpu_check.py selftest                      checks the helpers on made-up inputs

Every check appends one JSON line to RESULTS (run.sh's results.jsonl); `table` renders them.
TOL of `losses` is relative (|a - b| / |b| per step; 0: the same bits).
"""
import json
import random
import statistics
import sys
from array import array
from pathlib import Path

# The targets on an H100: ours / PyTorch's step time and peak GPU memory.
TARGETS = {
    "gpt2": {"time": 1.0, "memory": 1.5, "about": "GPT-2 small bf16, block 1024, batch 8 vs nanoGPT eager"},
    "shakespeare-char": {"time": 1.2, "memory": None, "about": "shakespeare-char recipe, dropout 0.2, bf16 vs nanoGPT eager"},
    "smollm2-135m": {"time": 1.0, "memory": None, "about": "SmolLM2-135M-shaped Llama bf16 vs transformers eager"},
}


def make_data(out, vocab, tokens):
    """nanoGPT's raw format; the first id is vocab - 1 so the trainer's vocabulary is `vocab`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    for name, n in (("train.bin", tokens), ("val.bin", max(tokens // 10, 4096))):
        ids = array("H", [vocab - 1] + [rng.randrange(vocab) for _ in range(n - 1)])
        (out / name).write_bytes(ids.tobytes())


def step_records(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "step"]


def losses(a, b, tol):
    """Worst relative difference of the step losses of runs `a` and `b` (same steps)."""
    ra, rb = step_records(a), step_records(b)
    if not ra or [r["step"] for r in ra] != [r["step"] for r in rb]:
        raise SystemExit(f"{a} and {b} logged different steps")
    worst = 0.0
    for x, y in zip(ra, rb):
        if tol == 0:  # the same bits: losses and gradient norms
            same = x["loss"] == y["loss"] and x.get("grad_norm") == y.get("grad_norm")
            worst = max(worst, float(not same))
        else:
            worst = max(worst, abs(x["loss"] - y["loss"]) / max(abs(y["loss"]), 1e-12))
    return {"steps": len(ra), "worst": worst, "ok": worst <= tol, "first": [ra[0]["loss"], rb[0]["loss"]], "last": [ra[-1]["loss"], rb[-1]["loss"]]}


def peak_mib(mem_file):
    """Peak device memory used during a run over the first sample (nvidia-smi, MiB), or None."""
    try:
        values = [float(v) for v in Path(mem_file).read_text().split() if v.strip()]
    except FileNotFoundError:
        return None
    return max(values) - values[0] if len(values) > 1 else None


def ours(case, run_dir, mem_file, warmup):
    ms = [r["step_ms"] for r in step_records(run_dir)][warmup:]
    return {"case": case, "impl": "ours", "median_ms": statistics.median(ms), "mean_ms": statistics.mean(ms), "steps": len(ms), "peak_mib": peak_mib(mem_file)}


def torch_result(case, json_file, mem_file):
    lines = [l for l in Path(json_file).read_text().splitlines() if l.startswith("{")]
    r = json.loads(lines[-1])
    r["peak_mib"] = peak_mib(mem_file)
    return r


def fmt(v, unit=""):
    return "n/a" if v is None else f"{v:.1f}{unit}" if isinstance(v, float) else f"{v}{unit}"


def table(results, show=True):
    rows = [json.loads(l) for l in Path(results).read_text().splitlines() if l.strip()]
    out = ["| check | ours | reference | ratio / error | target | result |", "|---|---|---|---|---|---|"]
    failed = False
    bench = {}
    for r in rows:
        kind = r["kind"]
        if kind == "tests":
            ok = r["failed"] == 0 and r["passed"] > 0
            out.append(f"| {r['name']} | {r['passed']} passed, {r['failed']} failed | | {' '.join(r['failures']) or ''} | all pass | {'PASS' if ok else 'FAIL'} |")
        elif kind == "losses":
            ok = r["ok"]
            err = "bits differ" if r["tol"] == 0 and r["worst"] else f"{r['worst']:.2e}"
            tol = "same bits" if r["tol"] == 0 else f"<= {r['tol']:g} relative"
            out.append(f"| {r['name']} ({r['steps']} steps) | {r['last'][0]:.5f} | {r['last'][1]:.5f} | {err} | {tol} | {'PASS' if ok else 'FAIL'} |")
        elif kind == "bench":
            bench.setdefault(r["case"], {})[r.get("variant") or r["impl"]] = r
        else:
            ok = False
            out.append(f"| {r.get('name', kind)} | | | {r.get('error', '')} | | FAIL |")
        failed |= not ok
    for case, t in TARGETS.items():
        p = bench.get(case, {}).get("pytorch")
        for variant in ("default", "triton"):
            o = bench.get(case, {}).get(variant)
            if not o and not (p and variant == "default"):
                continue
            about = f"{t['about']}, ours {'with Triton kernels' if variant == 'triton' else 'default (point 1)'}"
            if not o or not p:
                out.append(f"| {about}: step time | {fmt(o and o['median_ms'], ' ms')} | {fmt(p and p['median_ms'], ' ms')} | | <= {t['time']}x | FAIL (no result) |")
                failed = True
                continue
            ratio = o["median_ms"] / p["median_ms"]
            out.append(f"| {about}: step time | {o['median_ms']:.1f} ms | {p['median_ms']:.1f} ms | {ratio:.2f}x | <= {t['time']}x | {'met' if ratio <= t['time'] else 'not met'} |")
            extra = f" (max_allocated {fmt(p.get('max_allocated_mib'), ' MiB')})"
            if o.get("peak_mib") is not None and p.get("peak_mib"):
                mratio = o["peak_mib"] / p["peak_mib"]
                target = f"<= {t['memory']}x" if t["memory"] else "(reported)"
                verdict = "" if not t["memory"] else "met" if mratio <= t["memory"] else "not met"
                out.append(f"| {about}: peak GPU memory (nvidia-smi) | {o['peak_mib']:.0f} MiB | {p['peak_mib']:.0f} MiB{extra} | {mratio:.2f}x | {target} | {verdict} |")
            else:
                out.append(f"| {about}: peak GPU memory | {fmt(o.get('peak_mib'), ' MiB')} | {fmt(p.get('peak_mib'), ' MiB')}{extra} | | | n/a |")
    if show:
        print("\n".join(out))
    return 1 if failed else 0


def selftest():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        make_data(d / "data", 50304, 5000)
        ids = array("H")
        ids.frombytes((d / "data" / "train.bin").read_bytes())
        assert len(ids) == 5000 and max(ids) == 50303 and ids[0] == 50303
        for name, ls in (("a", [3.0, 2.5, 2.0]), ("b", [3.0, 2.5, 2.001]), ("c", [3.0, 2.5, 2.0])):
            (d / name).mkdir()
            recs = [{"kind": "eval", "step": 0}] + [{"kind": "step", "step": i + 1, "loss": l, "step_ms": 10.0 + i} for i, l in enumerate(ls)]
            (d / name / "metrics.jsonl").write_text("\n".join(map(json.dumps, recs)))
        assert losses(d / "a", d / "c", 0)["ok"]
        assert not losses(d / "a", d / "b", 0)["ok"]
        assert losses(d / "a", d / "b", 1e-3)["ok"] and not losses(d / "a", d / "b", 1e-4)["ok"]
        (d / "mem").write_text("500\n900\n1700\n800\n")
        assert peak_mib(d / "mem") == 1200 and peak_mib(d / "none") is None
        o = ours("gpt2", d / "a", d / "mem", 1)
        assert o["median_ms"] == 11.5 and o["peak_mib"] == 1200
        res = d / "results.jsonl"
        good = [
            {"kind": "tests", "name": "t", "passed": 2, "failed": 0, "failures": []},
            {"kind": "losses", "name": "l", "tol": 0, **losses(d / "a", d / "c", 0)},
            {"kind": "bench", "variant": "default", **o},
            {"kind": "bench", "case": "gpt2", "impl": "pytorch", "median_ms": 12.0, "peak_mib": 1000.0, "max_allocated_mib": 800.0},
        ]
        res.write_text("\n".join(map(json.dumps, good)))
        assert table(res, show=False) == 0
        bad = good + [{"kind": "losses", "name": "m", "tol": 0, **losses(d / "a", d / "b", 0)}]
        res.write_text("\n".join(map(json.dumps, bad)))
        assert table(res, show=False) == 1
    print("gpu_check.py selftest: ok")


def main(argv):
    cmd, *a = argv or ["help"]
    if cmd == "make-data":
        make_data(a[0], int(a[1]), int(a[2]))
    elif cmd == "losses":
        print(json.dumps(losses(a[0], a[1], float(a[2]))))
    elif cmd == "ours":
        print(json.dumps(ours(a[0], a[1], a[2], int(a[3]))))
    elif cmd == "torch":
        print(json.dumps(torch_result(a[0], a[1], a[2])))
    elif cmd == "table":
        return table(a[0])
    elif cmd == "selftest":
        selftest()
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
