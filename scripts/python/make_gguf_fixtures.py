#!/usr/bin/env python3
"""Reference GGUF files for `trainer export --format gguf`, made by llama.cpp's own converter.

    .venv-py/bin/python scripts/python/make_gguf_fixtures.py [OUT_DIR]
        # OUT_DIR defaults to trainer/tests/fixtures/gguf (the committed fixtures)

Four tiny random models (one block, widths 256 so that every matrix row is whole q8_0 and
k-quant blocks), each with a tokenizer of another kind:

- `llama`   LlamaForCausalLM, f32, byte-level BPE with Llama 3's split regex (`llama-bpe`);
- `qwen2`   Qwen2ForCausalLM, bf16, tied head, q/k/v biases, BPE with Qwen2's regex (`qwen2`);
- `qwen3`   Qwen3ForCausalLM, bf16, q/k norms, GPT-2's byte-level pre-tokenizer (`gpt-2`);
- `mistral` MistralForCausalLM, bf16, a SentencePiece-style tokenizer (BPE with byte fallback,
            `▁` for spaces: llama.cpp's `llama` tokenizer model);
- `llama3_rope` LlamaForCausalLM, bf16, Llama 3.1's rotary scaling (`rope_type: llama3`, which
            the converter writes as the tensor `rope_freqs.weight`; its values are recorded too);
- `llama_linear_rope` LlamaForCausalLM, bf16, linear rotary scaling (factor 4: the converter's
            `rope.scaling.type` and `rope.scaling.factor` keys).

Each is saved with `save_pretrained` (config.json, model.safetensors, tokenizer files) and
converted by llama.cpp's `convert_hf_to_gguf.py` to f32, f16, bf16 and q8_0, and the f32 file
quantized by llama.cpp's `llama_model_quantize` (what `llama-quantize F32.gguf OUT.gguf Q4_K_M`
runs; from the llama-cpp-python package, `pip install llama-cpp-python==0.3.36`, which builds
llama.cpp) to q4_k_m. `expected.json` records, per type, every metadata key (type and value) and
every tensor's type, shape and the sha256 of its bytes, and for q4_k_m each tensor's root mean
square distance from the f32 tensor once dequantized; `cargo test` (trainer/tests/gguf.rs)
exports the same models and compares. Keys derived from the directory name by the converter's naming heuristics
(`general.name`, `general.size_label`, `general.basename`, `general.finetune`) are left out.

The converter comes from the llama-cpp-python 0.3.36 source package on PyPI (its vendored
llama.cpp, commit recorded in expected.json), downloaded once and checked by sha256. Its BPE
pre-tokenizer detection hashes the tokens of a test string against published tokenizers, which
these locally trained ones cannot match: `get_vocab_base_pre` is replaced by a lookup of the
pre-tokenizer's structure (the same table as the trainer's `export/gguf/vocab.rs`); everything
else runs as llama.cpp ships it. `cargo test` never runs this script.
"""
import hashlib
import io
import json
import os
import runpy
import shutil
import sys
import tarfile
import tempfile
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "trainer", "tests", "fixtures", "gguf")
CHAT = os.path.join(ROOT, "trainer", "tests", "fixtures", "chat")
SHAKESPEARE = os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt")

SDIST = "llama_cpp_python-0.3.36"
SDIST_URL = ("https://files.pythonhosted.org/packages/ec/e9/"
             "e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/" + SDIST + ".tar.gz")
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
CACHE = os.path.join(ROOT, ".venv-py", "llama.cpp-" + SDIST)

NAMING = {"general.name", "general.size_label", "general.basename", "general.finetune",
          "general.version"}
TYPES = ["f32", "f16", "bf16", "q8_0"]
Q4_K_M = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def converter():
    """The vendored llama.cpp directory (convert_hf_to_gguf.py, convert_lora_to_gguf.py,
    conversion/, gguf-py/)."""
    llama = os.path.join(CACHE, "llama.cpp")
    if all(os.path.isfile(os.path.join(llama, f))
           for f in ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py")):
        return llama
    data = urllib.request.urlopen(SDIST_URL).read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SDIST_SHA256:
        sys.exit(f"{SDIST_URL}: sha256 {digest}, expected {SDIST_SHA256}")
    prefix = SDIST + "/vendor/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/", "gguf-py/",
              "LICENSE")
    head = SDIST + "/.git/modules/vendor/llama.cpp/HEAD"  # the vendored submodule's commit
    os.makedirs(llama, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar.getmembers():
            if m.name.startswith(prefix) and m.name[len(prefix):].startswith(wanted):
                m.name = m.name[len(prefix):]
                tar.extract(m, llama, filter="data")
            elif m.name == head:
                with open(os.path.join(llama, "COMMIT"), "wb") as f:
                    f.write(tar.extractfile(m).read())
    return llama


def run_script(llama, script, args):
    """Runs llama.cpp's `script` (a converter) with the command-line `args`, in this process."""
    argv = sys.argv
    sys.argv = [script, *args]
    try:
        runpy.run_path(os.path.join(llama, script), run_name="__main__")
    finally:
        sys.argv = argv


def write_expected(name, d, expected):
    """Writes `expected` to `d`/expected.json (indent 1, UTF-8 as is, final newline)."""
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(name, "->", d)


def llama_cpp_commit(llama):
    path = os.path.join(llama, "COMMIT")
    return open(path).read().strip() if os.path.isfile(path) else "unknown"


def bpe_tokenizer(style, split):
    """A fixture BPE tokenizer (trained on tinyshakespeare, see fixtures/chat) with `split` as
    its pre-tokenizer regex (None: GPT-2's ByteLevel regex as trained)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(CHAT, style))
    if split is not None:
        j = json.loads(tok.backend_tokenizer.to_str())
        j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]}
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
        fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(j)),
                                       bos_token=tok.bos_token, eos_token=tok.eos_token,
                                       pad_token=tok.pad_token)
        fast.chat_template = tok.chat_template
        tok = fast
    return tok


def sentencepiece_tokenizer():
    """A Llama-2-style tokenizer.json: BPE with byte fallback over `▁`-joined words, `<unk>`,
    `<s>`, `</s>` and the 256 byte pieces `<0x00>`... first, then pieces trained on
    tinyshakespeare."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast
    text = open(SHAKESPEARE, encoding="utf-8").read()[:200_000]
    norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = norm
    trainer_tok.train_from_iterator(text.split("\n"), trainers.BpeTrainer(
        vocab_size=160, show_progress=False))
    learned = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" "))
                                                    for m in learned["merges"]],
                               unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = norm
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    from tokenizers import AddedToken, processors
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ bos_token if loop.first }}[{{ m['role'] }}] "
                          "{{ m['content'] }}{{ eos_token if m['role'] == 'assistant' }}\n{% endfor %}")
    return fast


def model(kind, tok, seed):
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
    common = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                  max_position_embeddings=128, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id)
    cls, cfg, dtype = {
        "llama": (LlamaForCausalLM, LlamaConfig(rms_norm_eps=1e-5, rope_theta=500000.0,
                                                tie_word_embeddings=False, **common), torch.float32),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(rms_norm_eps=1e-6, rope_theta=1e6,
                                                tie_word_embeddings=True, **common), torch.bfloat16),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(rms_norm_eps=1e-6, rope_theta=1e6, head_dim=64,
                                                tie_word_embeddings=True, **common), torch.bfloat16),
        "llama3_rope": (LlamaForCausalLM, LlamaConfig(
            rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}, **common), torch.bfloat16),
        "llama_linear_rope": (LlamaForCausalLM, LlamaConfig(
            rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
            **common), torch.bfloat16),
        "mistral": (MistralForCausalLM, MistralConfig(rms_norm_eps=1e-5, rope_theta=1e4,
                                                      sliding_window=64, tie_word_embeddings=False,
                                                      **common), torch.bfloat16),
    }[kind]
    torch.manual_seed(seed)
    m = cls(cfg)
    with torch.no_grad():
        for p in m.parameters():  # every tensor non-trivial, norms included
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    return m.to(dtype)


def quantize_q4_k_m(f32_path, out_path):
    """llama.cpp's own quantizer (the library `llama-quantize` calls), default parameters."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = Q4_K_M
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(f32_path.encode(), out_path.encode(), params)
    if rc != 0:
        sys.exit(f"llama_model_quantize {f32_path}: {rc}")


def errors(path, f32_path, gguf):
    """Per tensor, the RMS distance of the dequantized tensor from the f32 file's."""
    import numpy as np
    ref = {t.name: np.asarray(t.data, dtype=np.float32) for t in gguf.GGUFReader(f32_path).tensors}
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        deq = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(ref[t.name].shape)
        out[t.name] = float(np.sqrt(np.mean((deq.astype(np.float64) - ref[t.name]) ** 2)))
    return out


def describe(path, gguf):
    import numpy as np
    r = gguf.GGUFReader(path)
    keys = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k in NAMING:
            continue
        types = [gguf.GGUFValueType(t).name for t in f.types]
        value = f.contents()
        if isinstance(value, float):
            value = float(np.float32(value))
        keys[k] = {"type": types, "value": value}
    tensors = {t.name: {"type": t.tensor_type.name, "shape": [int(x) for x in reversed(t.shape)],
                        "sha256": hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()}
               for t in r.tensors}
    for t in r.tensors:
        if t.name == "rope_freqs.weight":
            tensors[t.name]["values"] = [float(v) for v in np.asarray(t.data, dtype=np.float32)]
    return {"keys": keys, "tensors": tensors}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT
    llama = converter()
    sys.path.insert(0, llama)
    sys.path.insert(1, os.path.join(llama, "gguf-py"))
    import gguf
    import transformers
    from conversion import base

    def pre_of(self, tokenizer):
        pre = json.load(open(self.dir_model / "tokenizer.json"))["pre_tokenizer"]
        if pre["type"] == "ByteLevel" and pre.get("use_regex", True):
            return "gpt-2"
        split = pre["pretokenizers"][0]["pattern"]["Regex"]
        return {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}[split]
    base.TextModel.get_vocab_base_pre = pre_of

    cases = [("llama", bpe_tokenizer("llama3", LLAMA3_SPLIT), 1),
             ("qwen2", bpe_tokenizer("qwen2_5", QWEN2_SPLIT), 2),
             ("qwen3", bpe_tokenizer("qwen2_5", None), 3),
             ("mistral", sentencepiece_tokenizer(), 4),
             ("llama3_rope", bpe_tokenizer("llama3", LLAMA3_SPLIT), 5),
             ("llama_linear_rope", bpe_tokenizer("llama3", LLAMA3_SPLIT), 6)]
    os.makedirs(out, exist_ok=True)
    for name, tok, seed in cases:
        d = os.path.join(out, name)
        shutil.rmtree(d, ignore_errors=True)
        model(name, tok, seed).save_pretrained(d)
        tok.save_pretrained(d)
        expected = {"llama_cpp": {"source": SDIST, "commit": llama_cpp_commit(llama)},
                    "transformers": transformers.__version__, "types": {}}
        with tempfile.TemporaryDirectory() as tmp:
            for t in TYPES:
                path = os.path.join(tmp, f"{t}.gguf")
                run_script(llama, "convert_hf_to_gguf.py", [d, "--outtype", t, "--outfile", path])
                expected["types"][t] = describe(path, gguf)
            q4 = os.path.join(tmp, "q4_k_m.gguf")
            quantize_q4_k_m(os.path.join(tmp, "f32.gguf"), q4)
            expected["types"]["q4_k_m"] = describe(q4, gguf)
            for name, e in errors(q4, os.path.join(tmp, "f32.gguf"), gguf).items():
                expected["types"]["q4_k_m"]["tensors"][name]["rms_error"] = e
        write_expected(name, d, expected)


if __name__ == "__main__":
    main()
