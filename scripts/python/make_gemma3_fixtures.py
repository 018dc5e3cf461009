#!/usr/bin/env python3
"""Reference fixtures for the trainer's Gemma 3 (text) model, made with Hugging Face transformers.

    /work/venv-py/bin/python scripts/python/make_gemma3_fixtures.py [OUT_DIR]
        # OUT_DIR defaults to trainer/tests/fixtures/gemma3 (the committed fixtures)

Each case is a tiny random `Gemma3ForCausalLM` (eager attention, f32, fixed seed, every tensor
overwritten with random values: every RMSNorm weight N(0, 0.3^2), so `1 + w` is not 1), saved
with its outputs on a fixed batch in the layout of the Llama-family fixtures (see
trainer/tests/fixtures/llama/README.md): `config.json`, `model.safetensors`,
`expected.safetensors` (input_ids, labels, loss, logits, grad.<name>) and `generate.safetensors`
(prompt, greedy: `generate(do_sample=False)`, eos disabled, checked against an argmax loop
without a KV cache). The batch is T = 12 tokens against a sliding window of 4, so sliding and
full layers differ; token ids start at 1 (id 0 is Gemma's `pad_token_id`, whose embedding row
transformers' `nn.Embedding(padding_idx=0)` never updates).

Cases:
- `gemma3`: the transformers 5.x layout (`rope_parameters` with `sliding_attention` (theta 20)
  and `full_attention` (theta 1000), explicit `layer_types`), tied head, head_dim 16 (not
  hidden / heads), query_pre_attn_scalar 24 (not head_dim), no softcapping.
- `gemma3_legacy`: the older layout (top-level `rope_theta` 1000, `rope_local_base_freq` 20,
  `rope_scaling` linear x2 for the full layers only, `sliding_window_pattern` 2 instead of
  `layer_types`, `torch_dtype`), untied head, `attn_logit_softcapping` 2 and
  `final_logit_softcapping` 3. The script checks transformers reads it to the intended
  `rope_parameters` and layer types.

- `lora`: a PEFT LoRA adapter over the `gemma3` model (r 4, alpha 8, every projection of the
  Llama family's names targeted, `init_lora_weights=False` then lora_A ~ N(0, 0.1^2), lora_B ~
  N(0, 0.05^2) so every gradient depends on it), saved with PEFT's `save_pretrained`, and PEFT's
  loss, logits and every adapter gradient (by on-disk name) on the `gemma3` batch.

- `shape_270m`: a `config.json` shaped as Gemma 3 270M (hidden 640, 18 layers, 4 heads / 1
  kv head of 256, window 512, vocab 262144, the 4.x layout with `rope_local_base_freq`) and
  `parameters.json`, transformers' parameter count of it (built on the meta device: no weights).

`cargo test` never runs this: the outputs are committed.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Gemma3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixture_common import add_gradients, gradients, load_model  # noqa: E402
from make_llama_fixtures import generate_greedy, greedy_reference  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "trainer", "tests", "fixtures", "gemma3")

VOCAB = 301
B, T = 2, 12
PROMPT_LEN, NEW_TOKENS = 5, 20

COMMON = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 24,
    "sliding_window": 4,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}

CASES = {
    "gemma3": dict(
        COMMON,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 20.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
        tie_word_embeddings=True,
        dtype="float32",
        transformers_version=transformers.__version__,
    ),
    "gemma3_legacy": dict(
        COMMON,
        rope_theta=1000.0,
        rope_local_base_freq=20.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        sliding_window_pattern=2,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
        transformers_version="4.50.0",
    ),
}
SEEDS = {"gemma3": 24, "gemma3_legacy": 12}  # 24: a greedy continuation that is not one token repeated
WANT_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
WANT_ROPE = {
    "gemma3": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 20.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
    },
    "gemma3_legacy": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 20.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
    },
}


def randomise(model, gen):
    """Every parameter random: weights N(0, 0.2^2), RMSNorm weights N(0, 0.3^2) (Gemma's norm
    scales by 1 + w)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_((0.3 if name.endswith("norm.weight") else 0.2) * noise)


def make_batch(seed):
    g = torch.Generator().manual_seed(2000 + seed)
    input_ids = torch.randint(1, VOCAB, (B, T), generator=g)
    labels = input_ids.clone()
    labels[0, T // 2 - 1] = -100
    labels[1, -3:] = -100
    return dict(input_ids=input_ids, labels=labels)


def forward(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)


def outputs(batch, out):
    """The batch and a forward's loss and logits, as the fixtures store them."""
    return {
        "input_ids": batch["input_ids"].to(torch.int64),
        "labels": batch["labels"].to(torch.int64),
        "loss": out.loss.detach().to(torch.float32).reshape(()),
        "logits": out.logits.detach().to(torch.float32),
    }


def write(d, name, tensors, case):
    """`tensors` as `d/name`, made_by naming the case and the versions (one metadata key: several
    would be written in hash order)."""
    made_by = (
        f"scripts/python/make_gemma3_fixtures.py case={case} peft={peft.__version__} "
        f"transformers={transformers.__version__} torch={torch.__version__.split('+')[0]}"
    )
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(d, name), metadata={"made_by": made_by})


def make_case(case, out_dir):
    seed = SEEDS[case]
    d = os.path.join(out_dir, case)
    if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(CASES[case], f, indent=2, sort_keys=True)
        f.write("\n")
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.layer_types == WANT_LAYER_TYPES, cfg.layer_types
    assert cfg.rope_parameters == WANT_ROPE[case], cfg.rope_parameters
    cfg._attn_implementation = "eager"
    print(f"== {case} (seed {seed})")
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).to(torch.float32)
    randomise(model, torch.Generator().manual_seed(1000 + seed))
    model.eval()
    batch = make_batch(seed)

    model.zero_grad(set_to_none=True)
    out = forward(model, batch)
    out.loss.backward()
    loss = out.loss.item()
    expected = outputs(batch, out)
    names = add_gradients(expected, model)

    g = torch.Generator().manual_seed(3000 + seed)
    prompt = torch.randint(1, VOCAB, (1, PROMPT_LEN), generator=g)
    greedy = generate_greedy(model, prompt, NEW_TOKENS)
    assert torch.equal(greedy, greedy_reference(model, prompt, NEW_TOKENS))

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        shutil.copy(os.path.join(tmp, "model.safetensors"), d)
        saved = json.load(open(os.path.join(tmp, "config.json")))
    # config.json stays the hand-written one (the layout under test); transformers' own save of
    # it goes beside it for reference
    with open(os.path.join(d, "config.saved.json"), "w") as f:
        json.dump(saved, f, indent=2, sort_keys=True)
        f.write("\n")
    write(d, "expected.safetensors", expected, case)
    write(d, "generate.safetensors", {"prompt": prompt.long(), "greedy": greedy.long()}, case)
    weights = load_file(os.path.join(d, "model.safetensors"))
    assert ("lm_head.weight" in weights) == (not cfg.tie_word_embeddings)
    assert set(weights) == set(names), set(weights) ^ set(names)
    reloaded = load_model(d)
    with torch.no_grad():
        assert forward(reloaded, batch).loss.item() == loss
    print(f"  loss {loss:.6f}; greedy {greedy[0, PROMPT_LEN:].tolist()}")
    return loss


LORA_TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def make_lora(out_dir):
    """PEFT LoRA over the `gemma3` case's model (read back from its directory)."""
    base = load_model(os.path.join(out_dir, "gemma3"))
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                     init_lora_weights=False, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(4000)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            if ".lora_A." in name or ".lora_B." in name:
                std = 0.1 if ".lora_A." in name else 0.05
                params[name].copy_(std * torch.randn(params[name].shape, generator=gen))
    model.eval()
    batch = make_batch(SEEDS["gemma3"])
    out = forward(model, batch)
    out.loss.backward()
    expected = outputs(batch, out)
    grads = gradients(
        model, lambda n: n.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
    )
    expected.update({f"grad.{n}": g for n, g in grads.items()})
    d = os.path.join(out_dir, "lora")
    if os.path.exists(d):
        shutil.rmtree(d)
    model.save_pretrained(d)
    acfg = json.load(open(os.path.join(d, "adapter_config.json")))
    acfg["target_modules"] = sorted(acfg["target_modules"])
    acfg["base_model_name_or_path"] = "../gemma3"
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump(acfg, f, indent=2, sort_keys=True)
        f.write("\n")
    for f in os.listdir(d):
        if f not in ("adapter_config.json", "adapter_model.safetensors"):
            os.remove(os.path.join(d, f))
    write(d, "expected.safetensors", expected, "lora")
    print(f"== lora: loss {out.loss.item():.6f}, {len(expected) - 4} adapter gradients")


SHAPE_270M = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 640,
    "initializer_range": 0.02,
    "intermediate_size": 2048,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 18,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 512,
    "torch_dtype": "bfloat16",
    "use_bidirectional_attention": False,
    "vocab_size": 262144,
}


def make_shape_270m(out_dir):
    d = os.path.join(out_dir, "shape_270m")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(SHAPE_270M, f, indent=2, sort_keys=True)
        f.write("\n")
    with torch.device("meta"):
        model = Gemma3ForCausalLM(AutoConfig.from_pretrained(d))
    n = sum(p.numel() for p in model.parameters())
    with open(os.path.join(d, "parameters.json"), "w") as f:
        json.dump({"parameters": n, "transformers": transformers.__version__}, f, indent=2)
        f.write("\n")
    print(f"== shape_270m: {n} parameters")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", nargs="?", default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    os.makedirs(args.out_dir, exist_ok=True)
    for case in CASES:
        make_case(case, args.out_dir)
    make_lora(args.out_dir)
    make_shape_270m(args.out_dir)
    for root, _, files in os.walk(args.out_dir):
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)


if __name__ == "__main__":
    main()
