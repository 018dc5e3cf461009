#!/usr/bin/env python3
"""Helpers of scripts/gpu/run.sh (standard library only: they run on this CPU machine too).

    gpu_check.py make-data DIR VOCAB TOKENS    random nanoGPT train.bin / val.bin (u16) ids < VOCAB
    gpu_check.py losses A B TOL                compare two runs' step losses (metrics.jsonl)
    gpu_check.py ours CASE RUN_DIR MEM_FILE WARMUP   a trainer run's bench result (JSON line)
    gpu_check.py torch CASE JSON_FILE MEM_FILE       a PyTorch bench result (JSON line)
    gpu_check.py counts IMPL CASE LONG SHORT STEPS MODE   driver calls per step from two cucount.c
                                               reports, and the kernels with the most GPU time
    gpu_check.py smoke SMOKE_JSONL RC          cubin_smoke.py's lines as one result (JSON line)
    gpu_check.py libtest LOG RC MODE           a test executable's libtest output as one result:
                                               passed / failed / ignored, the failed trials, and
                                               its status (MODE run: skipped CUDA trials fail)
    gpu_check.py table RESULTS                 the one markdown table (exit 1 if a check failed)
    gpu_check.py summary RESULTS PARTS HEADER  summary.md: the header, per-part status and time,
                                               the table (exit 1 if a check failed)
    gpu_check.py selftest                      checks the helpers on made-up inputs

Every check appends one JSON line to RESULTS (run.sh's results.jsonl); `table` renders them.
TOL of `losses` is relative (|a - b| / |b| per step; 0: the same bits). A row's "part" names the
run.sh part it came from; a bench row is a figure (a missed target is not a failure).
"""
import json
import random
import re
import statistics
import sys
from array import array
from pathlib import Path

# The targets on an H100: ours / PyTorch's step time and peak GPU memory.
TARGETS = {
    "gpt2": {"time": 1.0, "memory": 1.5, "about": "GPT-2 small bf16, block 1024, batch 8 vs nanoGPT eager"},
    "shakespeare-char": {"time": 1.2, "memory": None, "about": "shakespeare-char recipe, dropout 0.2, bf16 vs nanoGPT eager"},
    "smollm2-135m": {"time": 1.0, "memory": None, "about": "SmolLM2-135M-shaped Llama bf16 vs transformers (SDPA, autocast)"},
    "smollm2-135m-lora": {"time": 1.0, "memory": 0.7, "about": "SmolLM2-135M-shaped LoRA r16 all-linear, bf16 base, vs PEFT (SDPA, autocast)"},
}
COUNTED = ("launch", "alloc", "free", "sync", "read", "copy", "memset", "event")


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


def counts(impl, case, long_json, short_json, steps, mode):
    """Driver calls per step from two cucount.c reports (WARMUP + steps, and WARMUP steps), and
    the kernels that took the most GPU time in the shorter run (timed)."""
    long, short = (json.loads(Path(f).read_text()) for f in (long_json, short_json))
    steps = int(steps)
    per_step = {k: (long["counts"].get(k, 0) - short["counts"].get(k, 0)) / steps for k in COUNTED}
    total = short.get("kernel_ms_total") or 0.0
    top = [{"name": k["name"][:80], "n": k["n"], "ms": round(k["ms"], 3), "share": round(k["ms"] / total, 3) if total else None}
           for k in short.get("kernels", [])[:12]]
    out = {"kind": "counts", "impl": impl, "case": case, "steps": steps, "per_step": per_step,
           "kernel_ms_total": round(total, 3), "top_kernels": top, "untimed": short.get("untimed", 0)}
    if not any(long["counts"].values()):
        # the rehearsal: the CPU trainer and CPU PyTorch make no driver calls
        out.update(status="skipped" if mode != "run" else "fail", why="no CUDA driver call counted")
    else:
        out["status"] = "pass"
    return out


def smoke(jsonl, rc):
    """cubin_smoke.py's output: one row (ok / failed cubins; a kill before the end fails)."""
    try:
        recs = [json.loads(l) for l in Path(jsonl).read_text().splitlines() if l.strip().startswith("{")]
    except FileNotFoundError:
        recs = []
    dev = next((r for r in recs if r.get("kind") == "smoke-device"), {})
    cubins = [r for r in recs if r.get("kind") == "smoke"]
    summary = next((r for r in recs if r.get("kind") == "smoke-summary"), None)
    bad = [r for r in cubins if not r.get("ok")]
    arch = dev.get("arch") or "?"
    name = f"cubin smoke ({arch}{', fake driver' if dev.get('fake') else ''}): load, launch, sync"
    failures = [f"{r['cubin']}: {r.get('error', '?')}"[:160] for r in bad]
    if dev.get("ok") is False:
        failures.append(f"device: {dev.get('error')}")
    notes = [f"{r['cubin']}: without the opt-in {r['without_optin']}" for r in cubins if r.get("without_optin")]
    notes += [f"{r['cubin']}: local {r['local_bytes']} B" for r in cubins if r.get("local_bytes")]
    out = {"kind": "smoke", "name": name, "passed": len(cubins) - len(bad), "failed": len(bad),
           "failures": failures, "notes": notes, "rc": int(rc)}
    if summary and "skipped" in summary:
        out.update(status="skipped", why=summary["skipped"])
    elif summary is None or int(rc) not in (0, 1) or dev.get("ok") is False:
        last = f" (the last done: {cubins[-1]['cubin']})" if cubins else ""
        out.update(status="fail", why=f"cubin_smoke.py ended early (rc={rc}) after {len(cubins)} cubins{last}")
    else:
        out["status"] = "pass" if not bad and int(rc) == 0 else "fail"
    return out


LIBTEST_RESULT = re.compile(r"test result: (\w+)\. (\d+) passed; (\d+) failed; (\d+) ignored")
LIBTEST_FAILED = re.compile(r"^test (\S+) \.\.\. FAILED", re.M)


def libtest(log, rc, mode):
    """One test executable's run: libtest's counts (summed over its "test result:" lines), the
    failed trials, and a status. Trials skipped for want of a device ("N ignored" with N > 0, or
    a "no CUDA device" line) fail on the GPU machine (mode run) and are "skipped" elsewhere."""
    text = Path(log).read_text(errors="replace")
    rc = int(rc)
    passed = failed = ignored = 0
    results = LIBTEST_RESULT.findall(text)
    for _, p, f, i in results:
        passed, failed, ignored = passed + int(p), failed + int(f), ignored + int(i)
    failures = LIBTEST_FAILED.findall(text)
    no_device = [l.strip()[:200] for l in text.splitlines() if "no CUDA device" in l]
    out = {"rc": rc, "passed": passed, "failed": failed, "ignored": ignored, "failures": failures,
           "no_device": no_device[:3]}
    if rc in (124, 137):
        out.update(status="fail", why="timed out")
    elif rc != 0 or failed:
        out.update(status="fail", why=f"rc={rc}" + (f", {failed} failed" if failed else ""))
    elif ignored or no_device:
        why = f"{ignored} trials ignored" if ignored else "no CUDA device"
        out.update(status="fail" if mode == "run" else "skipped", why=why + (" (no device opened)" if no_device and ignored else ""))
    elif not results:
        out.update(status="pass", why="no libtest summary line")
    elif not passed:
        out.update(status="fail", why="no trial ran")
    else:
        out["status"] = "pass"
    return out


def fmt(v, unit=""):
    return "n/a" if v is None else f"{v:.1f}{unit}" if isinstance(v, float) else f"{v}{unit}"


FAILED_PARTS = set()


def table(results, show=True, lines=None):
    rows = [json.loads(l) for l in Path(results).read_text().splitlines() if l.strip()]
    FAILED_PARTS.clear()
    out = ["| check | ours | reference | ratio / error | target | result |", "|---|---|---|---|---|---|"]
    failed = False
    bench = {}
    for r in rows:
        kind = r["kind"]
        ok = True
        if kind in ("smoke", "test-exe"):
            status = r.get("status", "fail")
            ok = status != "fail"
            counts = f"{r['passed']} {'ok' if kind == 'smoke' else 'passed'}, {r['failed']} failed"
            if kind == "test-exe":
                counts += f", {r['ignored']} ignored"
            detail = "; ".join(([r["why"]] if r.get("why") else []) + r.get("failures", [])[:6])
            if len(r.get("failures", [])) > 6:
                detail += f"; ... {len(r['failures']) - 6} more"
            if kind == "smoke" and r.get("notes"):
                detail += ("; " if detail else "") + "; ".join(r["notes"][:4])
            target = "all load, launch, sync" if kind == "smoke" else "all pass, none skipped"
            out.append(f"| {r['name']} | {counts} | | {detail.replace('|', '/')} | {target} | {status.upper()} |")
        elif kind == "skipped":
            ok = True
            out.append(f"| {r['name']} | | | {r.get('why', '')} | | SKIPPED |")
        elif kind == "tests":
            ok = r["failed"] == 0 and r["passed"] > 0
            out.append(f"| {r['name']} | {r['passed']} passed, {r['failed']} failed | | {' '.join(r['failures']) or ''} | all pass | {'PASS' if ok else 'FAIL'} |")
        elif kind == "losses":
            ok = r["ok"]
            err = "bits differ" if r["tol"] == 0 and r["worst"] else f"{r['worst']:.2e}"
            tol = "same bits" if r["tol"] == 0 else f"<= {r['tol']:g} relative"
            out.append(f"| {r['name']} ({r['steps']} steps) | {r['last'][0]:.5f} | {r['last'][1]:.5f} | {err} | {tol} | {'PASS' if ok else 'FAIL'} |")
        elif kind == "bench":
            bench.setdefault(r["case"], {})[r.get("variant") or r["impl"]] = r
        elif kind == "counts":
            ok = r.get("status") != "fail"
            ps = r["per_step"]
            calls = ", ".join(f"{ps[k]:.0f} {k}" for k in COUNTED if ps.get(k))
            top = "; ".join(f"{k['name']} {k['ms']:.1f} ms ({k['n']}x)" for k in r["top_kernels"][:5])
            detail = (f"top GPU time over {r['kernel_ms_total']:.1f} ms: {top}" if top else r.get("why", ""))
            out.append(f"| driver calls per step: {r['impl']} {r['case']} | {calls or 'none'} | | {detail.replace('|', '/')} | (reported) | {r.get('status', 'fail').upper()} |")
        else:
            ok = False
            out.append(f"| {r.get('name', kind)} | | | {r.get('error', '')} | | FAIL |")
        failed |= not ok
        if not ok:
            FAILED_PARTS.add(r.get("part", "?"))
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
                FAILED_PARTS.add("bench")
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
    if lines is not None:
        lines.extend(out)
    return 1 if failed else 0


def summary(results, parts, header):
    """summary.md: the header, one line per part (status, seconds, cap), the table so far."""
    lines = []
    status = table(results, show=False, lines=lines)
    rows = [json.loads(l) for l in Path(results).read_text().splitlines() if l.strip()]
    out = Path(header).read_text().rstrip("\n").splitlines()
    out[0] = "# " + out[0]
    out += ["", "| part | status | seconds | cap | note |", "|---|---|---|---|---|"]
    for line in Path(parts).read_text().splitlines():
        f = (line.split("\t") + [""] * 5)[:5]
        name, state, secs, cap, note = f
        mine = [r for r in rows if r.get("part") == name]
        if state in ("not asked", "skipped"):
            st = state.upper() if state == "skipped" else state
        elif name in FAILED_PARTS:
            st = "FAIL"
        elif mine and all(r.get("status") == "skipped" or r["kind"] == "skipped" for r in mine):
            st = "SKIPPED"
        else:
            st = "PASS" if name != "bench" else "done"
        if state == "cut":
            st += " (cut at its cap)"
        out.append(f"| {name} | {st} | {secs} | {cap} | {note} |")
    out += ["", "## Results", ""] + lines + ["", f"Correctness: {'FAILED' if status else 'no check failed'} "
            "(a missed speed or memory target is a figure, not a failure)."]
    print("\n".join(out))
    return status


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
        # libtest output: counts, failed trials, skipped CUDA trials (fail on the GPU machine)
        log = d / "t.log"
        log.write_text("running 3 tests\ntest a ... ok\ntest fam::b ... FAILED\ntest c ... ignored\n"
                       "test result: FAILED. 1 passed; 1 failed; 1 ignored; 0 measured; 0 filtered out\n")
        r = libtest(log, 101, "run")
        assert (r["passed"], r["failed"], r["ignored"], r["failures"], r["status"]) == (1, 1, 1, ["fam::b"], "fail")
        log.write_text("cuda_triton: no CUDA device (stub): 9 CUDA trials skipped\n"
                       "test result: ok. 1 passed; 0 failed; 9 ignored; 0 measured; 0 filtered out\n")
        assert libtest(log, 0, "run")["status"] == "fail" and libtest(log, 0, "rehearse")["status"] == "skipped"
        log.write_text("test result: ok. 4 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out\n")
        assert libtest(log, 0, "run")["status"] == "pass" and libtest(log, 124, "run")["status"] == "fail"
        # cucount reports: per step = the difference over the extra steps
        (d / "long.json").write_text(json.dumps({"counts": {"launch": 1100, "alloc": 40, "sync": 12}}))
        (d / "short.json").write_text(json.dumps({"counts": {"launch": 600, "alloc": 30, "sync": 7}, "kernel_ms_total": 8.0,
                                                  "kernels": [{"name": "k1", "n": 50, "ms": 6.0}, {"name": "k2", "n": 9, "ms": 2.0}]}))
        c = counts("ours", "gpt2", d / "long.json", d / "short.json", 5, "run")
        assert c["per_step"]["launch"] == 100 and c["per_step"]["alloc"] == 2 and c["per_step"]["sync"] == 1, c
        assert c["top_kernels"][0] == {"name": "k1", "n": 50, "ms": 6.0, "share": 0.75} and c["status"] == "pass", c
        (d / "zero.json").write_text(json.dumps({"counts": {}}))
        assert counts("torch", "gpt2", d / "zero.json", d / "zero.json", 5, "run")["status"] == "fail"
        assert counts("torch", "gpt2", d / "zero.json", d / "zero.json", 5, "rehearse")["status"] == "skipped"
        sm = d / "smoke.jsonl"
        sm.write_text("\n".join(map(json.dumps, [
            {"kind": "smoke-device", "arch": "sm90", "fake": False, "cc": "9.0"},
            {"kind": "smoke", "cubin": "a.f32.sm90", "ok": True},
            {"kind": "smoke", "cubin": "b.f32.sm90", "ok": False, "error": "CUDA_ERROR_INVALID_VALUE"}])))
        r = smoke(sm, 137)
        assert r["passed"] == 1 and r["failed"] == 1 and r["status"] == "fail"
        rows = [dict(r, part="smoke"), {"part": "tests", "kind": "test-exe", "name": "x", **libtest(log, 0, "run")},
                {"part": "train", "kind": "skipped", "name": "y", "why": "cap"}]
        res.write_text("\n".join(map(json.dumps, rows)))
        (d / "parts.tsv").write_text("smoke\tran\t3\t120\t\ntests\tran\t5\t240\t\ntrain\tcut\t9\t240\tcap\n")
        (d / "header.txt").write_text("GPU check\nline 2\n")
        import contextlib, io
        with contextlib.redirect_stdout(io.StringIO()) as buf:
            assert summary(res, d / "parts.tsv", d / "header.txt") == 1
        text = buf.getvalue()
        assert "| smoke | FAIL |" in text and "| tests | PASS |" in text and "| train | SKIPPED (cut at its cap) |" in text, text
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
    elif cmd == "counts":
        print(json.dumps(counts(*a)))
    elif cmd == "smoke":
        print(json.dumps(smoke(a[0], a[1])))
    elif cmd == "libtest":
        print(json.dumps(libtest(a[0], a[1], a[2])))
    elif cmd == "table":
        return table(a[0])
    elif cmd == "summary":
        return summary(a[0], a[1], a[2])
    elif cmd == "selftest":
        selftest()
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
