//! `trainer export`: a model as a Hugging Face model directory.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use trainer::export::gguf::{export_gguf, export_gguf_lora, GgufOptions, GgufType};
use trainer::export::{export as export_model, ExportOptions, WeightDtype};
use trainer::load::ModelDir;

/// The `export` flags.
#[derive(Args, Debug)]
pub(super) struct ExportArgs {
    /// A run or checkpoint directory, a Hugging Face model directory, or a hub model id.
    source: String,
    /// The model directory to write (new or empty, unless --force); with --format gguf, the
    /// file to write.
    out_dir: PathBuf,
    /// What to write: a Hugging Face model directory, or one GGUF file that llama.cpp runs
    /// (adapters merged in).
    #[arg(long, value_enum, default_value_t = Format::Hf)]
    format: Format,
    /// With --format gguf: the tensor types [default: bf16 for a model stored in bf16, f16
    /// otherwise, as llama.cpp's converter's `auto`].
    #[arg(long, value_enum)]
    gguf_type: Option<GgufType>,
    /// With --format gguf: leave the tokenizer out (llama.cpp then needs another file's);
    /// for tokenizers GGUF cannot express, such as a WordLevel vocabulary.
    #[arg(long)]
    gguf_no_tokenizer: bool,
    /// With --format gguf, for adapters (a LoRA run, a PEFT adapter directory): write only
    /// the adapters, as a GGUF LoRA file (llama.cpp's --lora, over the base exported on its
    /// own) [default: f32 tensors]; without it they are merged into one model file.
    #[arg(long)]
    gguf_lora: bool,
    /// dtype of the written weights [default: the dtype the source stored them in: its
    /// config.json's torch_dtype; f32 for a run trained from scratch, the pretrained model's
    /// for a run started --init-from one].
    #[arg(long, value_enum)]
    dtype: Option<WeightDtype>,
    /// The largest weights file (5GB, 500MB, 2GiB, or bytes): more is split into
    /// model-0000i-of-0000N.safetensors shards with model.safetensors.index.json.
    #[arg(long, default_value = "5GB", value_parser = size)]
    max_shard_size: u64,
    /// Replace OUT_DIR when it already holds files.
    #[arg(long)]
    force: bool,
    /// For adapters (a LoRA run, a PEFT adapter directory): write the base with the adapters
    /// merged in (W + s B A), a whole Hugging Face model; without it the adapters are
    /// written as a PEFT adapter directory.
    #[arg(long)]
    merge: bool,
    /// Export adapters even though they record another base model than the one found (a
    /// warning names both; without it they are refused).
    #[arg(long)]
    other_base: bool,
    /// The base model of adapters, instead of the one they name (a PEFT adapter's
    /// base_model_name_or_path, a LoRA run's init_from).
    #[arg(long, value_name = "MODEL")]
    init_from: Option<String>,
}

fn size(text: &str) -> std::result::Result<u64, String> {
    trainer::export::parse_size(text).map_err(|e| e.to_string())
}

/// The output formats of `trainer export`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Format {
    /// A Hugging Face model directory (or a PEFT adapter directory).
    Hf,
    /// One GGUF file (llama.cpp).
    Gguf,
}

pub(super) fn export(args: ExportArgs) -> Result<()> {
    if args.format == Format::Gguf {
        return gguf(args);
    }
    if args.gguf_type.is_some() || args.gguf_no_tokenizer || args.gguf_lora {
        anyhow::bail!("--gguf-type, --gguf-no-tokenizer and --gguf-lora go with --format gguf");
    }
    let options = ExportOptions {
        dtype: args.dtype,
        max_shard_size: args.max_shard_size,
        force: args.force,
        merge: args.merge,
        other_base: args.other_base,
    };
    let done = ModelDir::open_over(&args.source, args.init_from.as_deref())
        .and_then(|m| export_model(&m.with_other_base(args.other_base), &args.out_dir, &options))
        .with_context(|| format!("cannot export {}", args.source))?;
    outln!("exported    {} -> {}", args.source, done.dir.display());
    outln!("dtype       {} ({})", done.dtype, done.dtype_from);
    outln!(
        "weights     {} ({} bytes)",
        done.weight_files.join(", "),
        done.total_size
    );
    for (name, from) in &done.copied {
        outln!("copied      {name} (from {})", from.display());
    }
    Ok(())
}

fn gguf(args: ExportArgs) -> Result<()> {
    if args.dtype.is_some() || args.merge {
        anyhow::bail!(
            "--dtype and --merge are for --format hf: a GGUF file's types are --gguf-type, \
             and adapters are always merged into it"
        );
    }
    let options = GgufOptions {
        ty: args.gguf_type,
        tokenizer: !args.gguf_no_tokenizer,
        force: args.force,
        other_base: args.other_base,
    };
    let source = ModelDir::open_over(&args.source, args.init_from.as_deref())?
        .with_other_base(args.other_base);
    let write = match args.gguf_lora {
        true => export_gguf_lora,
        false => export_gguf,
    };
    let done = write(&source, &args.out_dir, &options)
        .with_context(|| format!("cannot export {}", args.source))?;
    outln!("exported    {} -> {}", args.source, done.path.display());
    outln!(
        "gguf        {} {:?}, {} tensors, {} bytes{}",
        done.architecture,
        done.ty,
        done.tensors,
        done.bytes,
        match (args.gguf_lora, done.tokenizer) {
            (true, _) => ", LoRA adapter",
            (false, true) => ", tokenizer inside",
            (false, false) => ", no tokenizer",
        }
    );
    Ok(())
}
