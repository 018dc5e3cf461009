#!/usr/bin/env python3
"""Load an exported model directory with Hugging Face transformers and run a fixture's batch.

    .venv-py/bin/python scripts/python/check_export.py MODEL_DIR FIXTURE_CASE_DIR [--expect-fixture]

MODEL_DIR: config.json plus model.safetensors, or shards listed in model.safetensors.index.json
(e.g. the trainer's export of a fixture model after some training steps).
FIXTURE_CASE_DIR: a directory of trainer/tests/fixtures/llama/ (expected.safetensors gives the
batch: input_ids, labels, position_ids if present; generate.safetensors gives the prompt).

Prints one JSON line: the loss of `model(input_ids, labels=labels[, position_ids=...],
use_cache=False)`, the greedy 20-token continuation of the fixture prompt (eos disabled, as the
fixtures were made), the fixture's own loss and continuation, and the model's class, dtype and
parameter count. Exits 1 if loading reports missing, unexpected or mismatched keys or errors (the
tied lm_head of a tied model is not reported missing by transformers), if a shard index does not
match its shards, if loading fails, or if `tie_word_embeddings` in config.json and the loaded
model disagree (transformers 5.x unties, with only a warning, a tied model whose checkpoint has
an lm_head.weight different from the embedding). With --expect-fixture it also exits 1 unless the loss is
within 1e-5 (relative) of the fixture's and the continuation is identical: the check for a
model that should equal the fixture (the fixture directory itself, or an export of its
untrained weights).
"""
import argparse
import json
import logging
import os
import re
import sys

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_llama_fixtures import generate_greedy  # noqa: E402

NEW_TOKENS = 20
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
               "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def fail(msg, **extra):
    print(json.dumps({"ok": False, "error": msg, **extra}))
    sys.exit(1)


def check_index(model_dir):
    """With a shard index: every shard it names exists, and the tensors in the shards are exactly
    the index's weight_map (transformers loads by the index and would not notice a tensor that
    is only in a shard)."""
    path = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(path):
        if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
            fail(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json")
        return None
    index = json.load(open(path))
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        fail(f"{path}: no weight_map")
    in_shards = {}
    for shard in sorted(set(weight_map.values())):
        sp = os.path.join(model_dir, shard)
        if not os.path.exists(sp):
            fail(f"{path}: shard {shard} is missing")
        with safe_open(sp, "pt") as f:
            for k in f.keys():
                if k in in_shards:
                    fail(f"tensor {k} is in both {in_shards[k]} and {shard}")
                in_shards[k] = shard
    wrong = {k: (v, in_shards.get(k)) for k, v in weight_map.items() if in_shards.get(k) != v}
    extra = sorted(set(in_shards) - set(weight_map))
    if wrong or extra:
        fail(f"{path} does not match the shards", wrong_shard=wrong, not_in_index=extra)
    # a shard file the index does not name at all (e.g. model-00001-of-00003 when the map lists
    # only 00002 and 00003)
    shard_re = re.compile(r"^model-\d+-of-\d+\.safetensors$")
    unlisted = sorted(
        f for f in os.listdir(model_dir) if shard_re.match(f) and f not in set(weight_map.values())
    )
    if unlisted:
        fail(f"{path}: shard files not named in weight_map", unlisted=unlisted)
    total = index.get("metadata", {}).get("total_size")
    if total is not None:
        size = 0
        for shard in sorted(set(weight_map.values())):
            with safe_open(os.path.join(model_dir, shard), "pt") as f:
                for k in f.keys():
                    t = f.get_slice(k)
                    n = 1
                    for d in t.get_shape():
                        n *= d
                    size += n * DTYPE_BYTES[t.get_dtype()]
        if size != total:
            fail(f"{path}: metadata.total_size {total} but the tensors hold {size} bytes")
    return sorted(set(weight_map.values()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("fixture_case_dir")
    ap.add_argument("--expect-fixture", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()

    # keep transformers' own loading warnings (printed to stderr) for the report
    warnings_seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings_seen.append(record.getMessage())

    transformers.utils.logging.get_logger("transformers").addHandler(Keep())

    shards = check_index(args.model_dir)
    try:
        config = AutoConfig.from_pretrained(args.model_dir)
        model, info = AutoModelForCausalLM.from_pretrained(
            args.model_dir,
            config=config,
            dtype=torch.float32,
            attn_implementation="eager",
            output_loading_info=True,
        )
    except Exception as e:  # noqa: BLE001 - any load failure is a failed check
        fail(f"loading failed: {type(e).__name__}: {e}", warnings=warnings_seen)
    problems = {k: sorted(map(str, v)) for k, v in info.items() if v}
    if problems:
        fail("loading reported problems", loading_info=problems, warnings=warnings_seen)
    model.eval()
    # A tied config must give a tied model. transformers 5.x unties silently (only a warning) when
    # the checkpoint holds an lm_head.weight that differs from the embedding.
    tied_config = bool(getattr(config, "tie_word_embeddings", False))
    tied_model = (
        model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    )
    if tied_config != tied_model:
        fail(
            f"tie_word_embeddings is {tied_config} in config.json but the loaded model's head is "
            f"{'tied' if tied_model else 'untied'}",
            warnings=warnings_seen,
        )
    ckpt_keys = set()
    for shard in shards or ["model.safetensors"]:
        with safe_open(os.path.join(args.model_dir, shard), "pt") as f:
            ckpt_keys.update(f.keys())

    exp = load_file(os.path.join(args.fixture_case_dir, "expected.safetensors"))
    gen = load_file(os.path.join(args.fixture_case_dir, "generate.safetensors"))
    batch = dict(input_ids=exp["input_ids"], labels=exp["labels"], use_cache=False)
    if "position_ids" in exp:
        batch["position_ids"] = exp["position_ids"]
    with torch.no_grad():
        loss = model(**batch).loss.item()
        prompt = gen["prompt"]
        greedy = generate_greedy(model, prompt, NEW_TOKENS)
    fixture_loss = exp["loss"].item()
    fixture_greedy = gen["greedy"][0, prompt.shape[1] :].tolist()
    continuation = greedy[0, prompt.shape[1] :].tolist()
    result = {
        "ok": True,
        "model_dir": args.model_dir,
        "fixture": args.fixture_case_dir,
        "class": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "config_dtype": str(getattr(config, "dtype", None)),
        "shards": shards,
        "tied": tied_model,
        "checkpoint_has_lm_head": "lm_head.weight" in ckpt_keys,
        "loss": loss,
        "greedy": continuation,
        "prompt": prompt[0].tolist(),
        "fixture_loss": fixture_loss,
        "fixture_greedy": fixture_greedy,
        "loss_rel_diff_to_fixture": abs(loss - fixture_loss) / abs(fixture_loss),
        "greedy_equals_fixture": continuation == fixture_greedy,
        "warnings": warnings_seen,
        "transformers": transformers.__version__,
    }
    if args.expect_fixture and not (
        result["loss_rel_diff_to_fixture"] <= 1e-5 and result["greedy_equals_fixture"]
    ):
        result["ok"] = False
        result["error"] = "--expect-fixture: loss or greedy continuation differs from the fixture"
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
