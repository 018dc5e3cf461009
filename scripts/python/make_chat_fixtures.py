#!/usr/bin/env python3
"""Reference fixtures for chat-template rendering and SFT tokenization, made with transformers + TRL.

    .venv-py/bin/python scripts/python/make_chat_fixtures.py [OUT_DIR]
        # OUT_DIR defaults to trainer/tests/fixtures/chat (the committed fixtures)

Per style a tiny byte-level BPE `tokenizer.json` (trained with the `tokenizers` package on
data/tinyshakespeare.txt, the style's special tokens added), a `tokenizer_config.json` (and for
smollm2 a `chat_template.jinja`, the transformers 5 layout) loadable with
`AutoTokenizer.from_pretrained`, and `cases.json`: conversations with transformers'
`apply_chat_template` output (text, ids, assistant masks) and TRL 1.16's tokenization of the
text and prompt-completion formats. See trainer/tests/fixtures/chat/README.md (written by this
script). `cargo test` never runs this: the outputs are committed. Re-running gives identical bytes.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import tokenizers
import transformers
import trl
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from trl.data_utils import _tokenize, common_prefix_length

from fixture_common import save_readme

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "trainer", "tests", "fixtures", "chat")
CORPUS = os.path.join(ROOT, "data", "tinyshakespeare.txt")
TRL_TEMPLATES = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
VOCAB = 320  # 256 byte symbols + ~60 merges + the special tokens

# SmolLM2-*-Instruct's chat_template (tokenizer_config.json of HuggingFaceTB/SmolLM2-135M-Instruct),
# written from knowledge of the published file: no copy ships in the installed packages.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|finetune_right_pad_id|>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def trl_template(name):
    with open(os.path.join(TRL_TEMPLATES, name + ".jinja")) as f:
        return f.read()


# style -> dict(family, template source, where the template goes, tokens, source note)
STYLES = {
    "llama3": dict(
        family="llama3",
        template=lambda: trl_template("llama3"),
        source="TRL 1.16's trl/chat_templates/llama3.jinja, the original Meta-Llama-3-Instruct template "
        "(identity copy kept by TRL to recognise the model)",
    ),
    "llama3_1": dict(
        family="llama3",
        template=lambda: trl_template("llama3_1"),
        source="TRL 1.16's trl/chat_templates/llama3_1.jinja, the original Llama-3.1-Instruct template "
        "(system header with 'Cutting Knowledge Date: December 2023' / 'Today Date: 26 Jul 2024' always "
        "emitted; tools machinery unused here). Llama-3.2's differs only in taking the date from "
        "strftime_now (not reproducible, so not included)",
    ),
    "llama3_training": dict(
        family="llama3",
        template=lambda: trl_template("llama3_training"),
        source="TRL 1.16's trl/chat_templates/llama3_training.jinja: llama3 with {% generation %} around "
        "each assistant message's content + <|eot_id|> (what SFTTrainer swaps in for assistant_only_loss)",
    ),
    "qwen2_5": dict(
        family="qwen",
        template=lambda: trl_template("qwen2_5"),
        source="TRL 1.16's trl/chat_templates/qwen2_5.jinja, the original Qwen2.5-Instruct template",
    ),
    "qwen2_5_training": dict(
        family="qwen",
        template=lambda: trl_template("qwen2_5_training"),
        source="TRL 1.16's trl/chat_templates/qwen2_5_training.jinja: qwen2_5 with {% generation %} around "
        "each assistant message after '<|im_start|>assistant' (so the mask covers '\\n' + content + "
        "'<|im_end|>\\n')",
    ),
    "smollm2": dict(
        family="smollm2",
        template=lambda: SMOLLM2_TEMPLATE,
        source="SmolLM2-Instruct's published template (HuggingFaceTB/SmolLM2-*-Instruct "
        "tokenizer_config.json), written from knowledge: no copy ships in the installed packages. "
        "Stored as chat_template.jinja (the transformers 5 layout), not in tokenizer_config.json",
        jinja_file=True,
    ),
}

# family -> tokenizer settings (as in the published tokenizers)
FAMILIES = {
    # Llama 3: specials after the regular vocabulary; the post-processor prepends <|begin_of_text|>;
    # no pad token published (Llama 3.1+ reserve <|finetune_right_pad_id|>, used here as pad).
    "llama3": dict(
        specials_first=False,
        specials=LLAMA3_SPECIALS,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
        nfc=False,
        prepend_bos=True,
    ),
    # Qwen2.5-Instruct: specials after the vocabulary, NFC normaliser, no BOS (bos_token null),
    # eos <|im_end|>, pad <|endoftext|>.
    "qwen": dict(
        specials_first=False,
        specials=CHATML_SPECIALS,
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        nfc=True,
        prepend_bos=False,
    ),
    # SmolLM2-Instruct: specials are ids 0.. (<|endoftext|> 0, <|im_start|> 1, <|im_end|> 2),
    # bos <|im_start|>, eos and pad <|im_end|>; the post-processor adds nothing.
    "smollm2": dict(
        specials_first=True,
        specials=CHATML_SPECIALS,
        bos="<|im_start|>",
        eos="<|im_end|>",
        pad="<|im_end|>",
        nfc=False,
        prepend_bos=False,
    ),
}


def conversation(name, *turns, add_generation_prompt=False):
    """A chat case: `turns` are (role, content) pairs."""
    return dict(
        name=name,
        add_generation_prompt=add_generation_prompt,
        messages=[{"role": role, "content": content} for role, content in turns],
    )


CONVERSATIONS = [
    conversation(
        "system_user_assistant",
        ("system", "You are a terse assistant."),
        ("user", "Who wrote the tempest?"),
        ("assistant", "Shakespeare wrote it."),
    ),
    conversation(
        "multi_turn",
        ("system", "Answer in one line."),
        ("user", "First citizen, speak."),
        ("assistant", "Before we proceed any further, hear me speak."),
        ("user", "Speak, speak."),
        ("assistant", "You are all resolved rather to die than to famish?"),
    ),
    conversation("no_system", ("user", "What is the king?"), ("assistant", "A thing of nothing.")),
    conversation("unicode", ("user", "Ça va? naïve café — 日本語 🙂"), ("assistant", "Très bien: ß, Ω, ñ, 🙂🙂.")),
    conversation(
        "whitespace_newlines",
        ("system", "  Keep the spacing.  "),
        ("user", "  line one\nline two\n\n  indented\n"),
        ("assistant", "\n  first\n\tsecond  \n"),
    ),
    conversation(
        "generation_prompt",
        ("system", "You are a terse assistant."),
        ("user", "Hello."),
        ("assistant", "Hi."),
        ("user", "And now?"),
        add_generation_prompt=True,
    ),
]

# TRL SFT, non-conversational formats (EOS appended when absent) and one conversational
# prompt-completion example.
TEXT_CASES = [
    dict(name="text", format="text", text="First Citizen:\nBefore we proceed any further, hear me speak."),
    dict(name="prompt_completion", format="prompt_completion", prompt="Question: who speaks first?\nAnswer:", completion=" The First Citizen."),
    dict(
        name="prompt_completion_conversational",
        format="prompt_completion_conversational",
        prompt=[
            {"role": "system", "content": "Answer in one line."},
            {"role": "user", "content": "Who speaks first?"},
        ],
        completion=[{"role": "assistant", "content": "The First Citizen."}],
    ),
]


def train_tokenizer(family):
    fam = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    if fam["nfc"]:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=fam["specials"] if fam["specials_first"] else [],
    )
    tok.train([CORPUS], trainer)
    if not fam["specials_first"]:
        tok.add_special_tokens(fam["specials"])
    if fam["prepend_bos"]:
        bos = fam["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A:0 {bos}:1 $B:1", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_style(style, out, tok_cache):
    spec = STYLES[style]
    family = spec["family"]
    fam = FAMILIES[family]
    if family not in tok_cache:
        tok_cache[family] = train_tokenizer(family)
    tok = tok_cache[family]
    template = spec["template"]()
    d = os.path.join(out, style)
    if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    tok.save(os.path.join(d, "tokenizer.json"), pretty=True)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": fam["bos"],
        "eos_token": fam["eos"],
        "pad_token": fam["pad"],
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }
    if spec.get("jinja_file"):
        with open(os.path.join(d, "chat_template.jinja"), "w") as f:
            f.write(template)
    else:
        cfg["chat_template"] = template
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")

    hf = AutoTokenizer.from_pretrained(d)
    assert isinstance(hf, PreTrainedTokenizerFast), type(hf)
    assert hf.chat_template == template
    assert hf.eos_token == fam["eos"] and hf.pad_token == fam["pad"] and hf.bos_token == fam["bos"]
    has_gen = "{% generation %}" in template or "{%- generation %}" in template

    cases = []
    for conv in CONVERSATIONS:
        msgs, agp = conv["messages"], conv["add_generation_prompt"]
        rendered = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
        ids = list(hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=agp, return_dict=True)["input_ids"])
        # apply_chat_template tokenizes the rendered text without adding special tokens
        assert ids == hf(rendered, add_special_tokens=False)["input_ids"], style
        assert tok.decode(ids, skip_special_tokens=False) == rendered, style
        case = dict(name=conv["name"], messages=msgs, add_generation_prompt=agp, rendered=rendered, input_ids=ids)
        if has_gen:
            r = hf.apply_chat_template(
                msgs, tokenize=True, add_generation_prompt=agp, return_dict=True, return_assistant_tokens_mask=True
            )
            assert list(r["input_ids"]) == ids
            case["assistant_masks"] = list(r["assistant_masks"])
            assert 1 in case["assistant_masks"]
        cases.append(case)

    sft = []
    eos = hf.eos_token
    for tc in TEXT_CASES:
        c = dict(tc)
        if tc["format"] == "text":
            # TRL: add_eos, then processing_class(text=...) (special tokens added: a BOS where the
            # tokenizer's post-processor adds one)
            text = tc["text"] if tc["text"].endswith(eos) else tc["text"] + eos
            c["text_with_eos"] = text
            c["input_ids"] = list(_tokenize(hf, text)["input_ids"])
            c["labels_note"] = "labels = input_ids (completion_only_loss does not apply)"
        elif tc["format"] == "prompt_completion":
            completion = tc["completion"] if tc["completion"].endswith(eos) else tc["completion"] + eos
            c["completion_with_eos"] = completion
            prompt_ids = list(_tokenize(hf, tc["prompt"])["input_ids"])
            pc_ids = list(_tokenize(hf, tc["prompt"] + completion)["input_ids"])
            n = common_prefix_length(prompt_ids, pc_ids)
            c["prompt_ids"] = prompt_ids
            c["input_ids"] = pc_ids
            c["completion_mask"] = [0] * n + [1] * (len(pc_ids) - n)
        else:
            # conversational: no EOS appended (the template ends the turn)
            prompt_ids = list(_tokenize(hf, tc["prompt"], add_generation_prompt=True)["input_ids"])
            r = _tokenize(hf, tc["prompt"] + tc["completion"], return_assistant_tokens_mask=has_gen)
            pc_ids = list(r["input_ids"])
            n = common_prefix_length(prompt_ids, pc_ids)
            c["prompt_ids"] = prompt_ids
            c["input_ids"] = pc_ids
            c["completion_mask"] = [0] * n + [1] * (len(pc_ids) - n)
            if has_gen:
                c["assistant_masks"] = list(r["assistant_masks"])
        sft.append(c)

    specials = {t: tok.token_to_id(t) for t in fam["specials"]}
    doc = dict(
        style=style,
        template_source=spec["source"],
        template_in="chat_template.jinja" if spec.get("jinja_file") else "tokenizer_config.json",
        has_generation_markers=has_gen,
        bos_token=fam["bos"],
        eos_token=fam["eos"],
        pad_token=fam["pad"],
        special_token_ids=specials,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        versions=dict(
            transformers=transformers.__version__, trl=trl.__version__, tokenizers=tokenizers.__version__
        ),
        cases=cases,
        sft_cases=sft,
    )
    with open(os.path.join(d, "cases.json"), "w") as f:
        f.write(dump(doc))
    return doc


def dump(doc):
    """JSON with each case on its own line (id lists stay on one line)."""
    head = {k: v for k, v in doc.items() if k not in ("cases", "sft_cases")}
    parts = ["{"]
    for k in sorted(head):
        parts.append(f"  {json.dumps(k)}: {json.dumps(head[k], ensure_ascii=False, sort_keys=True)},")
    for key in ("cases", "sft_cases"):
        parts.append(f'  "{key}": [')
        items = [json.dumps(c, ensure_ascii=False, sort_keys=True) for c in doc[key]]
        parts.append(",\n".join("    " + s for s in items))
        parts.append("  ]," if key == "cases" else "  ]")
    parts.append("}")
    text = "\n".join(parts) + "\n"
    assert json.loads(text) == json.loads(json.dumps(doc))
    return text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", nargs="?", default=DEFAULT_OUT)
    args = ap.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers.logging.set_verbosity_error()
    os.makedirs(args.out_dir, exist_ok=True)
    cache = {}
    docs = {s: write_style(s, args.out_dir, cache) for s in STYLES}
    # the training templates render exactly as the originals
    for train, orig in (("llama3_training", "llama3"), ("qwen2_5_training", "qwen2_5")):
        same = [a["rendered"] == b["rendered"] for a, b in zip(docs[train]["cases"], docs[orig]["cases"])]
        print(f"{train} renders as {orig}: {sum(same)}/{len(same)} cases")
        assert all(same)
    for s, doc in docs.items():
        print(f"{s}: vocab {doc['vocab_size']}, specials {doc['special_token_ids']}, "
              f"ids per case {[len(c['input_ids']) for c in doc['cases']]}")
    write_readme(args.out_dir, docs)


def write_readme(out, docs):
    lines = [
        "# Chat-template and SFT-tokenization reference fixtures",
        "",
        "Made by `scripts/python/make_chat_fixtures.py` with transformers' `apply_chat_template` and",
        "TRL's SFT tokenization; `cargo test` only reads these files. Do not edit them by hand: remake",
        "them with",
        "",
        "```",
        "scripts/python/setup.sh",
        ".venv-py/bin/python scripts/python/make_chat_fixtures.py",
        "```",
        "",
        f"Versions: transformers {transformers.__version__}, trl {trl.__version__}, tokenizers "
        f"{tokenizers.__version__}; Python {sys.version.split()[0]}. Re-running gives identical bytes.",
        "",
        "## Each style directory",
        "",
        "- `tokenizer.json`: a byte-level BPE (GPT-2 pre-tokenizer regex, ByteLevel decoder) trained with",
        f"  the `tokenizers` package on data/tinyshakespeare.txt, vocab_size {VOCAB} (the 256 byte symbols",
        "  plus ~60 merges) plus the style's special tokens, placed as in the published tokenizer:",
        "  - llama3 family: `<|begin_of_text|>`, `<|start_header_id|>`, `<|end_header_id|>`, `<|eot_id|>`,",
        "    `<|finetune_right_pad_id|>` after the regular vocabulary; post-processor TemplateProcessing",
        "    prepending `<|begin_of_text|>` (so `tok(text)` starts with BOS, like Llama 3);",
        "  - qwen family: `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` after the vocabulary; NFC normaliser;",
        "    no BOS (bos_token null, as Qwen2.5);",
        "  - smollm2: `<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2 (first, as SmolLM2); no BOS added.",
        "- `tokenizer_config.json`: `tokenizer_class` PreTrainedTokenizerFast, `bos_token`, `eos_token`,",
        "  `pad_token`, `chat_template` (except smollm2, whose template is in `chat_template.jinja`, the",
        "  layout transformers 5 writes). `AutoTokenizer.from_pretrained(dir)` loads each (checked).",
        "- `cases.json`: `style`, `template_source`, `template_in`, `has_generation_markers`, `bos_token`,",
        "  `eos_token`, `pad_token`, `special_token_ids`, `vocab_size`, `versions`, and",
        "  - `cases`: conversations, each `name`, `messages`, `add_generation_prompt`,",
        "    `rendered` = `tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`,",
        "    `input_ids` = the same with `tokenize=True` (= `tok(rendered, add_special_tokens=False)`: no",
        "    second BOS; checked), and with generation markers `assistant_masks`",
        "    (`return_dict=True, return_assistant_tokens_mask=True`; 1 = a token inside",
        "    `{% generation %}...{% endgeneration %}`). Cases: `system_user_assistant`, `multi_turn`,",
        "    `no_system` (Qwen2.5 and SmolLM2 insert their default system prompt), `unicode`,",
        "    `whitespace_newlines` (leading/trailing spaces and newlines: Llama 3 `| trim`s each content,",
        "    the ChatML templates do not), `generation_prompt` (ends in a user turn,",
        "    `add_generation_prompt=true`).",
        "  - `sft_cases`: TRL 1.16 SFTTrainer's tokenization (`_prepare_dataset`: `add_eos` then",
        "    `trl.data_utils._tokenize`):",
        "    - `text`: `text_with_eos` = text + eos_token (appended when absent), `input_ids` =",
        "      `tok(text_with_eos)` *with* special tokens (so llama3 styles start with",
        "      `<|begin_of_text|>`), labels = input_ids;",
        "    - `prompt_completion`: `completion_with_eos` = completion + eos_token, `prompt_ids` =",
        "      `tok(prompt)`, `input_ids` = `tok(prompt + completion_with_eos)`, `completion_mask` = 0 over",
        "      the common prefix of the two, 1 after (labels -100 where 0 with completion_only_loss, the",
        "      default for this format);",
        "    - `prompt_completion_conversational`: prompt/completion are message lists; no EOS appended;",
        "      `prompt_ids` = `apply_chat_template(prompt, add_generation_prompt=True)`, `input_ids` =",
        "      `apply_chat_template(prompt + completion)`, `completion_mask` as above, and with generation",
        "      markers `assistant_masks`.",
        "",
        "## Styles and where each template comes from",
        "",
        "| style | template in | generation markers | eos | source |",
        "|---|---|---|---|---|",
    ]
    for s, doc in docs.items():
        lines.append(
            f"| `{s}` | {doc['template_in']} | {'yes' if doc['has_generation_markers'] else 'no'} | "
            f"`{doc['eos_token']}` | {doc['template_source']} |"
        )
    lines += [
        "",
        "The `_training` templates render every case to the same text as their originals (checked).",
        "",
        "Rendering environment (transformers): Jinja2 sandbox with `trim_blocks=True`,",
        "`lstrip_blocks=True`, the `generation` block tag and loop controls; `bos_token`/`eos_token`/... are",
        "passed as template variables.",
        "",
    ]
    save_readme(out, lines)


if __name__ == "__main__":
    main()
