#!/usr/bin/env python3
"""Verify the golden exports of trainer/tests/llama_roundtrip.rs with transformers.

    UPDATE_GOLDEN=1 cargo test --release -p trainer --test llama_roundtrip   # writes the exports
    .venv-py/bin/python scripts/python/verify_roundtrip.py                   # this script

For each trainer/tests/fixtures/llama/roundtrip/<case>/ (the trainer's export of fixture <case>
after 20 training steps), loads it with AutoModelForCausalLM.from_pretrained through
check_export.py (which fails on missing, unexpected or mismatched keys), and writes
verified.json: transformers' loss of the fixture's batch and its greedy 20-token continuation.
Exits 1 if either differs from what the trainer recorded in ours.json (loss beyond 1e-5
relative, or any token). `cargo test` then compares against verified.json without Python.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "trainer", "tests", "fixtures", "llama")
CHECK = os.path.join(ROOT, "scripts", "python", "check_export.py")


def main():
    base = os.path.join(FIXTURES, "roundtrip")
    failed = False
    for case in sorted(os.listdir(base)):
        export = os.path.join(base, case)
        out = subprocess.run([sys.executable, CHECK, export, os.path.join(FIXTURES, case)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{case}: check_export.py failed:\n{out.stdout}{out.stderr}")
            failed = True
            continue
        theirs = json.loads(out.stdout.strip().splitlines()[-1])
        with open(os.path.join(export, "ours.json")) as f:
            ours = json.load(f)
        rel = abs(ours["loss"] - theirs["loss"]) / abs(theirs["loss"])
        same = ours["greedy"] == theirs["greedy"]
        verified = {
            "loss": theirs["loss"],
            "greedy": theirs["greedy"],
            "class": theirs["class"],
            "shards": theirs["shards"],
            "transformers": theirs["transformers"],
            "loss_rel_diff_to_ours": rel,
            "greedy_equals_ours": same,
        }
        with open(os.path.join(export, "verified.json"), "w") as f:
            json.dump(verified, f, indent=2)
            f.write("\n")
        print(f"{case}: transformers loss {theirs['loss']:.7f}, ours {ours['loss']:.7f} "
              f"(rel {rel:.1e}); greedy {'equal' if same else 'DIFFERENT'}")
        failed |= rel > 1e-5 or not same
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
