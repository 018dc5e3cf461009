#!/usr/bin/env python3
"""Reference fixtures for the DPO objective (trainer/tests/dpo.rs), made with TRL's DPOTrainer.

    .venv-py/bin/python scripts/python/make_dpo_fixtures.py [OUT_DIR]
        # OUT_DIR defaults to trainer/tests/fixtures/dpo (the committed fixtures)

A tiny random LlamaForCausalLM (`base/`) over the `llama3` chat-fixture tokenizer
(trainer/tests/fixtures/chat/llama3: byte-level BPE, vocab 325, Llama 3 chat template, BOS added to
plain text, EOS `<|eot_id|>`), a PEFT LoRA adapter on it (`adapter/`: random A and B, then 30
Adam steps of sigmoid DPO, so that every pair's reward margin exceeds 1e-2 and no logged mean is
near 0), the same adapter merged (`merged/`, the
full fine-tuning policy), preference records (`*.jsonl`) and, per case, what TRL 1.16's
`DPOTrainer` computes on one batch holding every record: the tokenisation (`prompt_ids`,
`chosen_ids`, `rejected_ids` per kept record, and the records dropped because their prompt fills
`max_length`), the loss, the six logged metrics (`rewards/chosen`, `rewards/rejected`,
`rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`), the reference
log-probabilities of each pair, and the gradient of the loss with respect to every trainable
tensor (`grads.<case>.safetensors`, names as on disk: PEFT's adapter names, or the model's).

Cases: data {strings, conversational, implicit strings, implicit conversational} x loss
{sigmoid, ipo, robust (label_smoothing 0.1)} with LoRA (reference: the base, adapters off), and
`full_*`: full fine-tuning of `merged/` with `precompute_ref_log_probs=True` and the base as the
reference model (so the reference log-probabilities are computed once, before the step).

Sensitivity checks (the script fails otherwise, and records the values in `cases.json`): the
loss with the policy as its own reference, with prompt tokens counted, and without the EOS
appended to string completions each differ from the real loss by more than 1e-3 relative.

`cargo test` never runs this: the outputs are committed. Re-running gives identical bytes.
"""
import copy
import json
import os
import shutil
import sys
import tempfile

import datasets
import peft
import torch
import transformers
import trl
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from trl import DPOConfig, DPOTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "trainer", "tests", "fixtures")
TOKENIZER = os.path.join(FIXTURES, "chat", "llama3")
DEFAULT_OUT = os.path.join(FIXTURES, "dpo")

SEED = 23
R, ALPHA = 4, 8
TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
A_STD, B_STD = 0.3, 0.3
BETA = 0.1
LABEL_SMOOTHING = 0.1
TRAIN_STEPS, TRAIN_LR = 30, 1e-2
MAX_LENGTH = 64

STRINGS = [
    {"prompt": "First Citizen: Before we proceed any further,",
     "chosen": " hear me speak.", "rejected": " we are resolved."},
    {"prompt": "All: Speak,", "chosen": " speak.", "rejected": " rather to die than to famish."},
    # chosen + prompt pass MAX_LENGTH: truncated at the end (keep_start)
    {"prompt": "MENENIUS: What work's, my countrymen, in hand? Where go you",
     "chosen": " with bats and clubs? The matter? speak, I pray you.",
     "rejected": " there?"},
    # the prompt alone fills MAX_LENGTH: dropped
    {"prompt": "First Citizen: We are accounted poor citizens, the patricians good. What "
               "authority surfeits on would relieve us: if they would yield us but the "
               "superfluity, while it were wholesome,",
     "chosen": " we might guess.", "rejected": " no."},
]

CONVERSATIONAL = [
    {"prompt": [{"role": "user", "content": "Who is there?"}],
     "chosen": [{"role": "assistant", "content": "A friend to the king."}],
     "rejected": [{"role": "assistant", "content": "Nobody."}]},
    {"prompt": [{"role": "system", "content": "Speak in verse."},
                {"role": "user", "content": "What news?"}],
     "chosen": [{"role": "assistant", "content": "The king is come."}],
     "rejected": [{"role": "assistant", "content": "None, my lord, none."}]},
]

IMPLICIT_STRINGS = [
    {"chosen": "BRUTUS: You speak o' the people, as if you were a god.",
     "rejected": "BRUTUS: You speak o' the king."},
    {"chosen": "Second Citizen: Would you proceed especially against Caius Marcius?",
     "rejected": "Second Citizen: Would you go?"},
]

IMPLICIT_CONVERSATIONAL = [
    {"chosen": [{"role": "user", "content": "Is the king well?"},
                {"role": "assistant", "content": "He is, my lord."}],
     "rejected": [{"role": "user", "content": "Is the king well?"},
                  {"role": "assistant", "content": "I know not."}]},
    {"chosen": [{"role": "user", "content": "Where is the queen?"},
                {"role": "assistant", "content": "In her chamber."}],
     "rejected": [{"role": "user", "content": "Where is the queen?"},
                  {"role": "assistant", "content": "Gone to the war, with all her men."}]},
]

DATA = {
    "strings": STRINGS,
    "conversational": CONVERSATIONAL,
    "implicit_strings": IMPLICIT_STRINGS,
    "implicit_conversational": IMPLICIT_CONVERSATIONAL,
}
LOSSES = ["sigmoid", "ipo", "robust"]
METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected"]


def base_model(vocab):
    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=320, eos_token_id=323,
        pad_token_id=324, attention_dropout=0.0,
    )
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model.eval()


def adapted(base):
    model = get_peft_model(copy.deepcopy(base), lora_config())
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_A" in name:
                p.copy_(A_STD * torch.randn(p.shape, generator=gen))
            elif "lora_B" in name:
                p.copy_(B_STD * torch.randn(p.shape, generator=gen))
    return model


def sequence_logps(model, ids, n_prompt):
    """Summed log-probabilities of `ids[n_prompt:]` given what precedes them."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp[n_prompt - 1:].sum()


def dpo_trained(policy, tok):
    """The adapter after TRAIN_STEPS steps of sigmoid DPO (Adam) on every record, from its
    random start: every pair's margin large and positive, the rewards away from 0 (the
    metrics' f32 noise is ~1e-6 absolute, so a mean near 0 could not be checked to 1e-5
    relative)."""
    pairs = []
    for records in DATA.values():
        tokens, *_ = run_trl(copy.deepcopy(policy), None, tok, records, "sigmoid")
        for t in tokens:
            n = len(t["prompt_ids"])
            pairs.append(((t["prompt_ids"] + t["chosen_ids"])[:MAX_LENGTH],
                          (t["prompt_ids"] + t["rejected_ids"])[:MAX_LENGTH], n))
    with torch.no_grad(), policy.disable_adapter():
        ref = [(sequence_logps(policy, c, n), sequence_logps(policy, r, n)) for c, r, n in pairs]
    params = [p for n, p in sorted(policy.named_parameters()) if "lora_" in n]
    opt = torch.optim.Adam(params, lr=TRAIN_LR)
    for _ in range(TRAIN_STEPS):
        opt.zero_grad()
        loss = 0
        for (c, r, n), (rc, rr) in zip(pairs, ref):
            d = (sequence_logps(policy, c, n) - rc) - (sequence_logps(policy, r, n) - rr)
            loss = loss - torch.nn.functional.logsigmoid(BETA * d)
        loss.backward()
        opt.step()
    return policy


def disk_name(name):
    return name.replace(".default.weight", ".weight")


def dpo_args(loss, out, precompute=False):
    return DPOConfig(
        output_dir=out, loss_type=[loss], beta=BETA,
        label_smoothing=LABEL_SMOOTHING if loss == "robust" else 0.0,
        max_length=MAX_LENGTH, truncation_mode="keep_start", per_device_train_batch_size=8,
        precompute_ref_log_probs=precompute, report_to="none", use_cpu=True, seed=0,
        dataset_num_proc=None, bf16=False, fp16=False, logging_steps=1,
        gradient_checkpointing=False,
    )


def lora_config():
    return LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0,
                      init_lora_weights=False, task_type="CAUSAL_LM")


def dpo_trainer(model, ref_model, tok, records, args):
    """TRL's DPOTrainer on `records`. A PEFT `model` is handed over as TRL's new-adapter path
    sees it (the base and a `peft_config`, so the reference is the base with the adapters
    off), then given the adapter's values."""
    ds = datasets.Dataset.from_list(records)
    if not isinstance(model, peft.PeftModel):
        return DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=ds,
                          processing_class=tok)
    trainer = DPOTrainer(model=fresh_base(model), ref_model=None, args=args, train_dataset=ds,
                         processing_class=tok, peft_config=lora_config())
    values = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" in name:
                p.copy_(values[name])
    return trainer


def fresh_base(peft_model):
    """The base model under a PEFT model, as a plain model (adapter layers removed)."""
    return copy.deepcopy(peft_model).unload()


def run_trl(model, ref_model, tok, records, loss, precompute=False, strip_eos=None):
    """One DPOTrainer batch over every record: (tokenised kept records, loss, metrics, grads,
    reference log-probs)."""
    with tempfile.TemporaryDirectory() as out:
        trainer = dpo_trainer(model, ref_model, tok, records, dpo_args(loss, out, precompute))
        rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
        if strip_eos is not None:
            for r in rows:
                for k in ("chosen_ids", "rejected_ids"):
                    if r[k] and r[k][-1] == strip_eos:
                        r[k] = r[k][:-1]
        batch = trainer.data_collator(rows)
        m = trainer.model
        m.train()
        m.zero_grad(set_to_none=True)
        trainer._metrics["train"].clear()
        value = trainer.compute_loss(m, batch)
        value.backward()
        metrics = {k: trainer._metrics["train"][k][-1] for k in METRICS}
        grads = {}
        for name, p in m.named_parameters():
            if p.requires_grad:
                grads["grad." + disk_name(name)] = p.grad.detach().clone().contiguous()
        # reference log-probs, as TRL computes them (adapters off / reference model)
        with torch.no_grad():
            if precompute:
                ref_c = torch.tensor([r["ref_chosen_logps"] for r in rows])
                ref_r = torch.tensor([r["ref_rejected_logps"] for r in rows])
            else:
                ref_c, ref_r = trainer.compute_ref_log_probs(m, batch)
        tokens = [{"prompt_ids": r["prompt_ids"], "chosen_ids": r["chosen_ids"],
                   "rejected_ids": r["rejected_ids"]} for r in rows]
        m.zero_grad(set_to_none=True)
        return tokens, float(value), metrics, grads, ref_c.tolist(), ref_r.tolist()


def policy_as_reference_loss(model, tok, records, loss):
    """The loss when the reference is the policy itself (logratios 0)."""
    with tempfile.TemporaryDirectory() as out:
        trainer = dpo_trainer(model, None, tok, records, dpo_args(loss, out))
        rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
        batch = trainer.data_collator(rows)
        trainer.compute_ref_log_probs = None  # unused below
        m = trainer.model
        with torch.no_grad():
            labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
            kw = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
            lp = m(**kw, labels=labels, fused_lm_head=True).log_probs.sum(1)
        c, r = lp.chunk(2)
        d = (c - c) - (r - r)
        return float(loss_of(loss, d, batch))


def loss_of(loss, delta, batch):
    f = torch.nn.functional
    if loss == "sigmoid":
        return (-f.logsigmoid(BETA * delta)).mean()
    if loss == "ipo":
        return ((delta - 1 / (2 * BETA)) ** 2).mean()
    eps = LABEL_SMOOTHING
    return ((-(1 - eps) * f.logsigmoid(BETA * delta) + eps * f.logsigmoid(-BETA * delta))
            / (1 - 2 * eps)).mean()


def prompt_counted_loss(policy, ref, tok, records, loss):
    """The loss and `logps/chosen` with every non-pad target counted (prompt tokens included)."""
    with tempfile.TemporaryDirectory() as out:
        trainer = dpo_trainer(policy, None, tok, records, dpo_args(loss, out))
        rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
        batch = trainer.data_collator(rows)
        batch["completion_mask"] = batch["attention_mask"].clone()
        batch["completion_mask"][:, 0] = 0
        m = trainer.model
        trainer._metrics["train"].clear()
        with torch.no_grad():
            value = trainer.compute_loss(m, batch)
        return float(value), trainer._metrics["train"]["logps/chosen"][-1]


def check_far(name, got, want):
    if abs(got - want) <= 1e-3 * abs(want):
        raise SystemExit(f"{name}: {got} is too close to the loss {want}")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    vocab = len(tok)
    base = base_model(vocab)
    base.save_pretrained(os.path.join(out, "base"))
    policy = dpo_trained(adapted(base), tok)
    adir = os.path.join(out, "adapter")
    policy.save_pretrained(adir)
    cfg_path = os.path.join(adir, "adapter_config.json")
    with open(cfg_path) as f:
        acfg = json.load(f)
    acfg["base_model_name_or_path"] = "../base"
    acfg["target_modules"] = sorted(acfg["target_modules"])
    with open(cfg_path, "w") as f:
        json.dump(acfg, f, indent=2, sort_keys=True)
        f.write("\n")
    for extra in ("README.md",):
        p = os.path.join(adir, extra)
        if os.path.exists(p):
            os.remove(p)
    merged = copy.deepcopy(policy).merge_and_unload()
    for p in merged.parameters():
        p.requires_grad_(True)  # PEFT froze the base; full fine-tuning trains every tensor
    merged.save_pretrained(os.path.join(out, "merged"))

    for name, records in DATA.items():
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

    cases = []
    for data, records in DATA.items():
        for loss in LOSSES:
            case = f"lora_{data}_{loss}"
            tokens, value, metrics, grads, ref_c, ref_r = run_trl(
                copy.deepcopy(policy), None, tok, records, loss)
            save_file(grads, os.path.join(out, f"grads.{case}.safetensors"),
                      metadata={"made_by": "scripts/python/make_dpo_fixtures.py"})
            margins = [BETA * ((c - rc) - (r - rr)) for c, r, rc, rr in
                       zip(*policy_logps(policy, tok, tokens), ref_c, ref_r)]
            if min(abs(m) for m in margins) <= 1e-2:
                raise SystemExit(f"{case}: a margin is below 1e-2: {margins}")
            small = {k: v for k, v in metrics.items() if k != "rewards/accuracies" and abs(v) < 0.2}
            if small:
                raise SystemExit(f"{case}: metrics too close to 0 to check: {small}")
            self_ref = policy_as_reference_loss(copy.deepcopy(policy), tok, records, loss)
            check_far(f"{case} policy as reference", self_ref, value)
            # sigmoid and robust see a shared prompt cancel out; the logged logps do not
            counted, counted_logps = prompt_counted_loss(copy.deepcopy(policy), None, tok,
                                                         records, loss)
            check_far(f"{case} prompt counted: logps/chosen", counted_logps,
                      metrics["logps/chosen"])
            if loss == "ipo":
                check_far(f"{case} prompt counted", counted, value)
            entry = dict(name=case, data=data, loss_type=loss, tuning="lora",
                         beta=BETA, label_smoothing=LABEL_SMOOTHING if loss == "robust" else 0.0,
                         max_length=MAX_LENGTH, records=len(records), kept=tokens,
                         dropped=len(records) - len(tokens), loss=value, metrics=metrics,
                         ref_chosen_logps=ref_c, ref_rejected_logps=ref_r, margins=margins,
                         loss_policy_as_reference=self_ref, loss_prompt_counted=counted,
                         logps_chosen_prompt_counted=counted_logps)
            if data in ("strings", "implicit_strings"):
                eos = tok.convert_tokens_to_ids(tok.eos_token)
                _, no_eos, *_ = run_trl(copy.deepcopy(policy), None, tok, records, loss,
                                        strip_eos=eos)
                check_far(f"{case} no EOS", no_eos, value)
                entry["loss_without_eos"] = no_eos
            cases.append(entry)
    for loss in LOSSES:
        case = f"full_strings_{loss}"
        tokens, value, metrics, grads, ref_c, ref_r = run_trl(
            copy.deepcopy(merged), copy.deepcopy(base), tok, STRINGS, loss, precompute=True)
        save_file(grads, os.path.join(out, f"grads.{case}.safetensors"),
                  metadata={"made_by": "scripts/python/make_dpo_fixtures.py"})
        cases.append(dict(name=case, data="strings", loss_type=loss, tuning="full",
                          beta=BETA, label_smoothing=LABEL_SMOOTHING if loss == "robust" else 0.0,
                          max_length=MAX_LENGTH, records=len(STRINGS), kept=tokens,
                          dropped=len(STRINGS) - len(tokens), loss=value, metrics=metrics,
                          ref_chosen_logps=ref_c, ref_rejected_logps=ref_r))
    doc = dict(
        made_by="scripts/python/make_dpo_fixtures.py",
        versions=dict(trl=trl.__version__, torch=torch.__version__,
                      transformers=transformers.__version__, peft=peft.__version__,
                      datasets=datasets.__version__),
        tokenizer="../chat/llama3",
        cases=cases,
    )
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    for c in cases:
        print(c["name"], c["loss"], c["dropped"], {k: round(v, 5) for k, v in c["metrics"].items()})


def policy_logps(policy, tok, tokens):
    """Summed completion log-probs of the policy for each kept record (unpadded)."""
    chosen, rejected = [], []
    with torch.no_grad():
        for t in tokens:
            for key, acc in (("chosen_ids", chosen), ("rejected_ids", rejected)):
                ids = (t["prompt_ids"] + t[key])[:MAX_LENGTH]
                n_prompt = len(t["prompt_ids"])
                logits = policy(input_ids=torch.tensor([ids])).logits[0, :-1].float()
                lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
                acc.append(float(lp[n_prompt - 1:].sum()))
    return chosen, rejected


if __name__ == "__main__":
    main()
