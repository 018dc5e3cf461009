#!/usr/bin/env python3
"""The README's DPO example data: data/letters-preference.jsonl.

    python3 scripts/python/make_letters_preference.py

96 conversational preference records in the embedded chat base's vocabulary (data/chat-base):
`Write the letter after each letter : k e m u`, chosen the right answer (`l f n v`), rejected
the letters copied (even records) or shifted the wrong way (odd records). Standard library only;
re-running gives identical bytes.
"""
import json
import os
import random

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
L = "abcdefghijklmnopqrstuvwxyz"


def main():
    rng = random.Random(7)
    lines = []
    for i in range(96):
        s = [rng.choice(L) for _ in range(4)]
        after = [L[(L.index(c) + 1) % 26] for c in s]
        before = [L[(L.index(c) - 1) % 26] for c in s]
        rejected = s if i % 2 == 0 else before
        rec = {
            "prompt": [{"role": "user",
                        "content": "Write the letter after each letter : " + " ".join(s)}],
            "chosen": [{"role": "assistant", "content": " ".join(after)}],
            "rejected": [{"role": "assistant", "content": " ".join(rejected)}],
        }
        lines.append(json.dumps(rec))
    with open(os.path.join(ROOT, "data", "letters-preference.jsonl"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
