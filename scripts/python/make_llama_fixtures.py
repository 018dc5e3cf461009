#!/usr/bin/env python3
"""Reference fixtures for the trainer's Llama-family models, made with Hugging Face transformers.

    .venv-py/bin/python scripts/python/make_llama_fixtures.py [OUT_DIR]
        # OUT_DIR defaults to trainer/tests/fixtures/llama (the committed fixtures)
        # --only CASE[,CASE...] to remake some cases

Each case is a tiny random model (eager attention, f32, fixed seed, every tensor overwritten with
non-trivial random values) saved with `save_pretrained`, plus the outputs of transformers on a
fixed batch: loss, logits, the gradient of every parameter, and a 20-token greedy continuation.
See trainer/tests/fixtures/llama/README.md (written by this script) for the file layout.
`cargo test` never runs this: the outputs are committed.
"""
import argparse
import json
import math
import os
import shutil
import sys
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from fixture_common import add_gradients, deterministic, load_model, save_files, save_readme

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "trainer", "tests", "fixtures", "llama")

VOCAB = 301
B, T = 2, 12
PROMPT_LEN, NEW_TOKENS = 5, 20

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    hidden_act="silu",
)

# llama3 rope chosen so that the head_dim/2 = 4 frequencies fall in all three bands (checked in
# check_llama3_bands): wavelengths 2*pi*500^(i/4) = 6.3, 29.7, 140.5, 664.3 against
# high_freq_wavelen = 64/4 = 16 and low_freq_wavelen = 64/1 = 64.
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
LINEAR_ROPE = dict(rope_type="linear", rope_theta=500.0, factor=4.0)


def llama_cfg(**kw):
    return LlamaConfig(
        **COMMON,
        rms_norm_eps=1e-5,
        rope_parameters=kw.pop("rope_parameters", dict(rope_type="default", rope_theta=10000.0)),
        **kw,
    )


# name -> (model class, config factory, seed, batch kind, description)
CASES = {
    "llama": (
        LlamaForCausalLM,
        lambda: llama_cfg(attention_bias=True, mlp_bias=True),
        1,
        "plain",
        "LlamaForCausalLM, untied, attention_bias (q,k,v,o biases) and mlp_bias (gate,up,down "
        "biases), default RoPE (theta 10000), GQA 4 query / 2 KV heads.",
    ),
    "llama3_rope": (
        LlamaForCausalLM,
        lambda: llama_cfg(rope_parameters=dict(LLAMA3_ROPE)),
        2,
        "plain",
        "LlamaForCausalLM with rope_type llama3 (theta 500, factor 8, low_freq_factor 1, "
        "high_freq_factor 4, original_max_position_embeddings 64): the 4 frequencies fall in "
        "all three bands (high: unchanged; middle: smoothed; two low: divided by factor). Also "
        "config.legacy.json, the transformers 4.x layout of the same config.",
    ),
    "llama_linear_rope": (
        LlamaForCausalLM,
        lambda: llama_cfg(rope_parameters=dict(LINEAR_ROPE)),
        3,
        "plain",
        "LlamaForCausalLM with rope_type linear, factor 4 (positions divided by 4), rope_theta 500.",
    ),
    "tied": (
        LlamaForCausalLM,
        lambda: llama_cfg(tie_word_embeddings=True),
        4,
        "plain",
        "LlamaForCausalLM with tie_word_embeddings: no lm_head.weight in model.safetensors; "
        "grad.model.embed_tokens.weight includes the head's contribution.",
    ),
    "qwen2": (
        Qwen2ForCausalLM,
        lambda: Qwen2Config(
            **COMMON, rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=10000.0)
        ),
        5,
        "plain",
        "Qwen2ForCausalLM, untied: q/k/v biases (always on in Qwen2), no o_proj or MLP bias.",
    ),
    "qwen3": (
        Qwen3ForCausalLM,
        lambda: Qwen3Config(
            **COMMON,
            head_dim=16,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        6,
        "plain",
        "Qwen3ForCausalLM, tied: q_norm/k_norm (RMSNorm over head_dim, before RoPE), head_dim 16 "
        "!= hidden 32 / 4 heads (q_proj [64, 32], o_proj [32, 64]).",
    ),
    "mistral_sliding": (
        MistralForCausalLM,
        lambda: MistralConfig(
            **COMMON,
            rms_norm_eps=1e-5,
            sliding_window=5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        7,
        "sliding",
        "MistralForCausalLM with sliding_window 5 and T = 16: key j is visible to query i iff "
        "i - 5 < j <= i.",
    ),
    "packed": (
        LlamaForCausalLM,
        lambda: llama_cfg(attention_bias=True, mlp_bias=True),
        1,
        "packed",
        "The `llama` model (same config, same seed, so the same weights) on B=1, T=16 holding 3 "
        "documents of lengths 6, 3, 7: position_ids restart at 0 per document, no attention_mask, "
        "so transformers builds a block-diagonal causal mask (masking_utils "
        "find_packed_sequence_indices); labels -100 at each document's first token. The loss "
        "equals running the 3 documents separately (token mean over all 13 predicted tokens).",
    ),
}
PACKED_DOCS = [6, 3, 7]


def randomise(model, gen):
    """Overwrite every parameter: weights N(0, 0.2), norm weights 1 + N(0, 0.3), biases N(0, 0.2)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * noise)
            else:
                p.copy_(0.2 * noise)


def make_model(cls, cfg, seed):
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32)
    randomise(model, torch.Generator().manual_seed(1000 + seed))
    model.eval()
    return model


def make_batch(kind, seed):
    g = torch.Generator().manual_seed(2000 + seed)
    if kind == "packed":
        t = sum(PACKED_DOCS)
        input_ids = torch.randint(0, VOCAB, (1, t), generator=g)
        position_ids = torch.cat([torch.arange(n) for n in PACKED_DOCS]).unsqueeze(0)
        labels = input_ids.clone()
        start = 0
        for n in PACKED_DOCS:
            labels[0, start] = -100
            start += n
        return dict(input_ids=input_ids, labels=labels, position_ids=position_ids)
    t = 16 if kind == "sliding" else T
    input_ids = torch.randint(0, VOCAB, (B, t), generator=g)
    labels = input_ids.clone()
    labels[0, t // 2 - 1] = -100  # one in the middle of row 0
    labels[1, -3:] = -100  # the last 3 of row 1
    return dict(input_ids=input_ids, labels=labels)


def forward(model, batch, **kw):
    """The training-path forward: no KV cache (HF Trainer sets config.use_cache=False and TRL's
    SFTTrainer passes use_cache=False; with a cache, transformers skips packed-sequence
    detection)."""
    args = dict(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
    if "position_ids" in batch:
        args["position_ids"] = batch["position_ids"]
    args.update(kw)
    return model(**args)


def loss_of(model, batch, **kw):
    with torch.no_grad():
        return forward(model, batch, **kw).loss.item()


def rel_diff(a, b):
    return abs(a - b) / max(abs(a), abs(b))


def assert_matters(case, what, loss, other):
    d = rel_diff(loss, other)
    print(f"  {case}: loss {loss:.6f}; {what}: {other:.6f} (rel diff {d:.3g})")
    assert d > 1e-3, f"{case}: {what} does not change the loss ({d})"


def check_llama3_bands(cfg):
    rp = cfg.rope_parameters
    dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    inv = [1.0 / rp["rope_theta"] ** (2 * i / dim) for i in range(dim // 2)]
    old = rp["original_max_position_embeddings"]
    low_wl = old / rp["low_freq_factor"]
    high_wl = old / rp["high_freq_factor"]
    bands = []
    for f in inv:
        wl = 2 * math.pi / f
        bands.append("low" if wl > low_wl else "high" if wl < high_wl else "middle")
    print(
        f"  llama3 wavelengths {[round(2 * math.pi / f, 2) for f in inv]} vs high<{high_wl} "
        f"low>{low_wl}: {bands}"
    )
    assert set(bands) == {"low", "middle", "high"}, bands


def generate_greedy(model, prompt, n):
    """`prompt` and `n` tokens after it by transformers' `generate`, eos disabled so that they are
    plain argmax steps."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        return model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
        )


def greedy_reference(model, prompt, n):
    """Argmax continuation recomputing the full sequence each step (no KV cache, no logits
    processors): what generate() must match."""
    ids = prompt
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=ids, use_cache=False).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def disabled_checks(case, cls, cfg, model, batch, loss):
    """Loss with the case's feature turned off must differ (only an assertion that the feature
    matters here; the Rust tests do their own)."""
    if case in ("llama3_rope", "llama_linear_rope"):
        c2 = cfg.__class__.from_dict(cfg.to_dict())
        c2.rope_parameters = dict(rope_type="default", rope_theta=cfg.rope_parameters["rope_theta"])
        m2 = cls(c2).to(torch.float32).eval()
        m2.load_state_dict(model.state_dict())
        assert_matters(case, "without rope scaling", loss, loss_of(m2, batch))
    elif case in ("llama", "qwen2"):
        m2 = clone(cls, cfg, model)
        with torch.no_grad():
            for n, p in m2.named_parameters():
                if n.endswith(".bias"):
                    p.zero_()
        assert_matters(case, "biases zeroed", loss, loss_of(m2, batch))
        if case == "llama":
            for kind in ("self_attn", "mlp"):
                m3 = clone(cls, cfg, model)
                with torch.no_grad():
                    for n, p in m3.named_parameters():
                        if n.endswith(".bias") and f".{kind}." in n:
                            p.zero_()
                assert_matters(case, f"{kind} biases zeroed", loss, loss_of(m3, batch))
    elif case == "qwen3":
        m2 = clone(cls, cfg, model)
        for layer in m2.model.layers:
            layer.self_attn.q_norm = torch.nn.Identity()
            layer.self_attn.k_norm = torch.nn.Identity()
        assert_matters(case, "q_norm/k_norm removed", loss, loss_of(m2, batch))
        m3 = clone(cls, cfg, model)
        with torch.no_grad():
            for layer in m3.model.layers:
                layer.self_attn.q_norm.weight.fill_(1.0)
                layer.self_attn.k_norm.weight.fill_(1.0)
        assert_matters(case, "q_norm/k_norm weights set to 1", loss, loss_of(m3, batch))
    elif case == "mistral_sliding":
        c2 = cfg.__class__.from_dict(cfg.to_dict())
        c2.sliding_window = None
        m2 = cls(c2).to(torch.float32).eval()
        m2.load_state_dict(model.state_dict())
        assert_matters(case, "sliding_window None", loss, loss_of(m2, batch))
    elif case == "packed":
        plain = {k: v for k, v in batch.items() if k != "position_ids"}
        assert_matters(case, "unpacked (plain causal, positions 0..15)", loss, loss_of(model, plain))
        # per-document runs: the token-mean over all documents equals the packed loss
        total, count, start = 0.0, 0, 0
        out = forward(model, batch)
        for n in PACKED_DOCS:
            doc = dict(
                input_ids=batch["input_ids"][:, start : start + n],
                labels=batch["labels"][:, start : start + n],
            )
            with torch.no_grad():
                o = forward(model, doc)
            k = int((doc["labels"][:, 1:] != -100).sum())
            total += o.loss.item() * k
            count += k
            torch.testing.assert_close(o.logits, out.logits[:, start : start + n], rtol=1e-5, atol=1e-5)
            start += n
        print(f"  packed: separate documents give {total / count:.6f} over {count} tokens")
        assert abs(total / count - loss) < 1e-5, (total / count, loss)
        # what a forward with the config default use_cache=True gives (a DynamicCache is made, and
        # transformers then does not look for packed sequences): printed for the README.
        with torch.no_grad():
            lc = forward(model, batch, use_cache=True).loss.item()
        print(f"  packed: the same call with use_cache=True gives {lc:.6f} (no block-diagonal mask)")
    elif case == "tied":
        print("  tied: no disabled-feature check (untying is not a switch)")


def clone(cls, cfg, model):
    m2 = cls(cfg).to(torch.float32).eval()
    m2.load_state_dict(model.state_dict())
    return m2


def legacy_config(cfg_json):
    """transformers 4.x layout of a v5 config.json: top-level rope_theta and rope_scaling, torch_dtype."""
    d = dict(cfg_json)
    rp = dict(d.pop("rope_parameters"))
    d["rope_theta"] = rp.pop("rope_theta")
    if rp.get("rope_type", "default") != "default":
        d["rope_scaling"] = rp
    else:
        d["rope_scaling"] = None
    if "dtype" in d:
        d["torch_dtype"] = d.pop("dtype")
    d["transformers_version"] = "4.45.0"
    return d


def make_case(case, out_dir):
    cls, cfg_fn, seed, kind, _ = CASES[case]
    cfg = cfg_fn()
    cfg._attn_implementation = "eager"
    cfg.dtype = torch.float32
    print(f"== {case} ({cls.__name__}, seed {seed})")
    model = make_model(cls, cfg, seed)
    assert model.config._attn_implementation == "eager"
    batch = make_batch(kind, seed)
    if case == "llama3_rope":
        check_llama3_bands(cfg)

    # forward + backward on the fixture batch
    model.zero_grad(set_to_none=True)
    out = forward(model, batch)
    out.loss.backward()
    loss = out.loss.item()
    with torch.no_grad():
        # the default forward (no use_cache argument) agrees except where packing is involved
        if kind != "packed":
            args = {k: v for k, v in batch.items()}
            assert abs(model(**args).loss.item() - loss) < 1e-6
    disabled_checks(case, cls, cfg, model, batch, loss)

    expected = {
        "input_ids": batch["input_ids"].to(torch.int64).contiguous(),
        "labels": batch["labels"].to(torch.int64).contiguous(),
        "loss": out.loss.detach().to(torch.float32).reshape(()).contiguous(),
        "logits": out.logits.detach().to(torch.float32).contiguous(),
    }
    if "position_ids" in batch:
        expected["position_ids"] = batch["position_ids"].to(torch.int64).contiguous()
    names = add_gradients(expected, model)

    # greedy generation: eos disabled so the 20 tokens are plain argmax steps
    g = torch.Generator().manual_seed(3000 + seed)
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=g)
    greedy = generate_greedy(model, prompt, NEW_TOKENS)
    ref = greedy_reference(model, prompt, NEW_TOKENS)
    assert greedy.shape == (1, PROMPT_LEN + NEW_TOKENS), greedy.shape
    assert torch.equal(greedy, ref), (greedy, ref)

    # write
    d = os.path.join(out_dir, case)
    if os.path.exists(d):
        shutil.rmtree(d)
    save_files(model, d)
    # one key: safetensors writes metadata keys in hash order, so several would make the bytes
    # differ between otherwise identical runs
    meta = {
        "made_by": f"scripts/python/make_llama_fixtures.py case={case} "
        f"transformers={transformers.__version__} torch={torch.__version__.split('+')[0]}"
    }
    save_file(expected, os.path.join(d, "expected.safetensors"), metadata=meta)
    save_file(
        {"prompt": prompt.to(torch.int64).contiguous(), "greedy": greedy.to(torch.int64).contiguous()},
        os.path.join(d, "generate.safetensors"),
        metadata=meta,
    )

    # checks on what was written
    weights = load_file(os.path.join(d, "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in weights
    else:
        assert "lm_head.weight" in weights
    assert set(weights) == set(names), set(weights) ^ set(names)
    reloaded = load_model(d)
    assert abs(loss_of(reloaded, batch) - loss) < 1e-6
    if case == "llama3_rope":
        cfg_json = json.load(open(os.path.join(d, "config.json")))
        legacy = legacy_config(cfg_json)
        with open(os.path.join(d, "config.legacy.json"), "w") as f:
            json.dump(legacy, f, indent=2, sort_keys=True)
            f.write("\n")
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(os.path.join(d, "config.legacy.json"), os.path.join(tmp, "config.json"))
            shutil.copy(os.path.join(d, "model.safetensors"), tmp)
            lcfg = AutoConfig.from_pretrained(tmp)
            assert lcfg.rope_parameters == cfg_json["rope_parameters"], (
                lcfg.rope_parameters,
                cfg_json["rope_parameters"],
            )
            lm = load_model(tmp)
            ll = loss_of(lm, batch)
            with torch.no_grad():
                torch.testing.assert_close(forward(lm, batch).logits, out.logits.detach(), rtol=0, atol=0)
        print(f"  llama3_rope: config.legacy.json reads to the same rope_parameters; loss {ll:.6f}")
        assert ll == loss
    sizes = {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d))}
    print(f"  loss {loss:.6f}; files {sizes}")
    return loss, sum(sizes.values())


def write_readme(out_dir, results):
    lines = [
        "# Llama-family reference fixtures",
        "",
        "Made by `scripts/python/make_llama_fixtures.py` with Hugging Face transformers; `cargo test`",
        "only reads these files. Do not edit them by hand: remake them with",
        "",
        "```",
        "scripts/python/setup.sh                                 # .venv-py, pinned (scripts/python/requirements.txt)",
        ".venv-py/bin/python scripts/python/make_llama_fixtures.py",
        "```",
        "",
        f"Versions: transformers {transformers.__version__}, torch {torch.__version__.split('+')[0]} (CPU, "
        f"1 thread), safetensors, numpy as pinned in scripts/python/requirements.txt; Python "
        f"{sys.version.split()[0]}.",
        "",
        "## Cases",
        "",
        "All: 2 layers, hidden 32, 4 query heads, 2 KV heads (GQA), head_dim 8 (except qwen3), "
        f"intermediate 48, vocab {VOCAB}, max_position_embeddings 128, silu, f32, eager attention. Every "
        "parameter is overwritten after init with random values (weights and embeddings N(0, 0.2^2), "
        "biases N(0, 0.2^2), RMSNorm weights 1 + N(0, 0.3^2)), so a misplaced bias or norm shows.",
        "",
        "| case | class | B x T | loss | what it exercises |",
        "|---|---|---|---|---|",
    ]
    for case, (loss, _) in results.items():
        cls, _, _, kind, desc = CASES[case]
        bt = "1 x 16" if kind == "packed" else "2 x 16" if kind == "sliding" else f"{B} x {T}"
        lines.append(f"| `{case}` | {cls.__name__} | {bt} | {loss:.6f} | {desc} |")
    lines += [
        "",
        "## Files in each case directory",
        "",
        "- `config.json`: the model's config as `save_pretrained` writes it (transformers 5.x layout:",
        "  `rope_parameters` holding `rope_type`/`rope_theta`/..., `dtype`). `llama3_rope` also has",
        "  `config.legacy.json`: the same config in the transformers 4.x layout (top-level `rope_theta`,",
        "  `rope_scaling: {rope_type: llama3, ...}`, `torch_dtype`); the script checks that transformers",
        "  reads it to the same `rope_parameters`, logits and loss. It is converted by the script from",
        "  config.json (not written by a 4.x transformers; `transformers_version` is set to 4.45.0, as",
        "  in Llama-3.2's published config).",
        "- `model.safetensors`: f32 weights with the HF names (`model.embed_tokens.weight`,",
        "  `model.layers.{i}.self_attn.q_proj.weight`, ..., `model.norm.weight`, `lm_head.weight`);",
        "  tied models (`tied`, `qwen3`) have no `lm_head.weight`.",
        "- `expected.safetensors`:",
        "  - `input_ids` [B, T] I64, `labels` [B, T] I64 (-100 = ignored: in the plain cases index",
        "    T/2-1 of row 0 and the last 3 of row 1; in `packed` each document's first token),",
        "    `position_ids` [1, 16] I64 (only `packed`);",
        "  - `loss` scalar f32: `model(input_ids, labels=labels, use_cache=False).loss` (plus",
        "    `position_ids=` in `packed`): transformers' shifted cross-entropy, mean over the",
        "    labels != -100 of `labels[:, 1:]`;",
        "  - `logits` [B, T, V] f32;",
        "  - `grad.<parameter name>` f32 for every parameter: the gradient of that loss (for tied",
        "    models `grad.model.embed_tokens.weight` includes the head's contribution).",
        "- `generate.safetensors`: `prompt` [1, 5] I64 and `greedy` [1, 25] I64 =",
        "  `model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)` with",
        "  `eos_token_id=None` (in the call and in `generation_config`) so generation cannot stop",
        "  early and no logits processor is active (`min_new_tokens` only suppresses an eos, and there",
        "  is none): every new token is the plain argmax. The script checks that `generate` (with its",
        "  KV cache) equals an argmax loop recomputing the whole sequence without a cache.",
        "",
        "The safetensors headers' `__metadata__` (`made_by`) name the case and the versions.",
        "",
        "## Notes",
        "",
        "- `use_cache=False` is passed in the forward, as in training (HF Trainer sets",
        "  `config.use_cache = False`; TRL's SFTTrainer passes `use_cache=False`). The saved configs keep",
        "  transformers' default `use_cache: true`; with it, `model(input_ids, position_ids=...)` makes",
        "  an empty DynamicCache, and transformers only looks for packed sequences",
        "  (`find_packed_sequence_indices` in masking_utils.py) when there is no cache and no",
        "  attention_mask, so that call gives a plain causal mask over the whole packed row. For the",
        "  other cases the two agree (checked).",
        "- `packed` uses the same config and seed as `llama`, hence the same weights (and the same",
        "  `generate.safetensors`).",
        "- Disabled-feature checks (each must move the loss by > 1e-3 relative; printed by the script):",
        "  rope scaling replaced by default RoPE (`llama3_rope`, `llama_linear_rope`); biases zeroed",
        "  (`llama`: all, attention only, MLP only; `qwen2`); q_norm/k_norm replaced by identity and",
        "  their weights set to 1 (`qwen3`); `sliding_window: null` (`mistral_sliding`); the packed row",
        "  run as one causal sequence (`packed`). `tied` has none.",
        "- Deterministic: fixed seeds, `torch.set_num_threads(1)`.",
        "",
    ]
    save_readme(out_dir, lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", nargs="?", default=DEFAULT_OUT)
    ap.add_argument("--only", help="comma-separated cases (the README is then not rewritten)")
    args = ap.parse_args()
    deterministic()
    cases = args.only.split(",") if args.only else list(CASES)
    os.makedirs(args.out_dir, exist_ok=True)
    results = {c: make_case(c, args.out_dir) for c in cases}
    print()
    total = 0
    for c, (loss, size) in results.items():
        print(f"{c:20s} loss {loss:.6f}  {size / 1024:.0f} KiB")
        total += size
    print(f"total {total / 1024:.0f} KiB")
    if not args.only:
        write_readme(args.out_dir, results)


if __name__ == "__main__":
    main()
