//! The run configuration: defaults, a TOML file, and `--key value` overrides from the CLI.
//!
//! One list of fields (in the `train_config!` invocation below) generates the config struct, its
//! defaults, and the matching clap overrides, so a new option is added in one place and shows up
//! in `trainer train --help` with its documentation. Values written as text (`--dtype bf16`,
//! `--remat every:2`) are typed (`types`): parsed once, when the config is read.

pub(crate) mod decimal;
mod device;
mod eval;
mod options;
mod paths;
pub(crate) mod resume;
mod sections;
mod types;
mod validate;

use std::path::{Path, PathBuf};

use candle_remat::Policy;
use serde::{Deserialize, Serialize};

pub use candle_peft::TargetModules;
pub use options::{OptionReader, Options, RunKeys};
pub(crate) use types::tracks_streams;
pub use types::{
    Arch, BaseQuant, DeviceList, DeviceSpec, LossScale, ModuleList, Parallelism, Precision,
    ScheduleKind,
};

use crate::data::{ChatTaskKind, DataKind, DataOrder, DataSource, DataSpec};
use crate::model::gpt2::GptConfig;
use crate::model::{Dims, Kernels, ModelConfig};
use crate::{Error, Result};

/// The most tokens `sample_tokens` may ask for at each evaluation (the sample is generated
/// one token at a time, and its tokens kept).
pub(crate) const MAX_SAMPLE_TOKENS: usize = 1 << 16;

/// The most micro-batches one optimiser step may accumulate (`grad_accum`). A step's time
/// grows with it and its log line comes at its end: 65,536 micro-batches of 4,096 tokens are
/// 268M tokens a step, beyond any recipe, while a mistyped 10^12 would never log a step.
pub(crate) const MAX_GRAD_ACCUM: usize = 1 << 16;

macro_rules! train_config {
    ($(
        $(#[doc = $doc:literal])*
        #[resume($class:ident)]
        $name:ident : $ty:ty = $default:expr
    ),* $(,)?) => {
        /// Everything a training run needs. Load with [`TrainConfig::from_toml_file`], override
        /// with [`Overrides`], check with [`TrainConfig::validate`].
        #[derive(Clone, Debug, PartialEq, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct TrainConfig {
            $( $(#[doc = $doc])* pub $name: $ty, )*
        }

        // Every writer of a config (run.toml, --print-config, inspect, trainer_state.json)
        // goes through this: f32 fields as their shortest decimal ([`decimal`]).
        impl Serialize for TrainConfig {
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                use serde::ser::SerializeStruct;
                #[allow(unused_imports)]
                use decimal::{PutAny, PutF32};
                let mut st = s.serialize_struct("TrainConfig", Self::FIELDS.len())?;
                $( (&decimal::Field(&self.$name)).put(&mut st, stringify!($name))?; )*
                st.end()
            }
        }

        impl Default for TrainConfig {
            fn default() -> Self {
                TrainConfig { $( $name: $default, )* }
            }
        }

        impl TrainConfig {
            /// Every field, in declaration order, with what a resumed run may do with it (see
            /// [`OnResume`]). Generated from the field list: a field cannot be declared
            /// without its class.
            pub const FIELDS: &'static [(&'static str, OnResume)] =
                &[$( (stringify!($name), OnResume::$class), )*];

            /// The fields whose values differ between `self` and `other`: name, class, and
            /// both values (as JSON, the config file's spelling of strings and numbers).
            pub(crate) fn changed_fields(&self, other: &TrainConfig) -> Vec<ChangedField> {
                let mut v = Vec::new();
                $(
                    if self.$name != other.$name {
                        v.push(ChangedField {
                            name: stringify!($name),
                            class: OnResume::$class,
                            old: erased_json::Show::show(&self.$name),
                            new: erased_json::Show::show(&other.$name),
                        });
                    }
                )*
                v
            }
        }

        /// Command-line overrides of [`TrainConfig`] fields (`--n-layer 6`, `--lr 3e-4`, ...).
        #[derive(Clone, Debug, Default)]
        #[cfg_attr(feature = "cli", derive(clap::Args))]
        pub struct Overrides {
            $(
                $(#[doc = $doc])*
                #[cfg_attr(feature = "cli", arg(
                    long,
                    allow_negative_numbers = true,
                    help_heading = "Config (overrides the --config file)"
                ))]
                pub $name: Option<$ty>,
            )*
        }

        impl Overrides {
            /// Writes every given override into `cfg`.
            pub fn apply(&self, cfg: &mut TrainConfig) {
                $( if let Some(v) = &self.$name { cfg.$name = v.clone(); } )*
            }

            /// Names of the fields that were given.
            pub fn given(&self) -> Vec<&'static str> {
                let mut v = Vec::new();
                $( if self.$name.is_some() { v.push(stringify!($name)); } )*
                v
            }
        }
    };
}

/// What a resumed run (`trainer train --resume RUN --key value`) may do with a config field.
///
/// Every field of [`TrainConfig`] is classified where it is declared (`#[resume(...)]` in the
/// `train_config!` list): the macro does not accept a field without a class, so a new option
/// cannot be forgotten. [`TrainConfig::FIELDS`] lists them all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum OnResume {
    /// The resumed run applies a new value: how long it trains (`max_iters`), the learning-rate
    /// schedule and the optimiser's hyper-parameters (rebuilt from the config; its state comes
    /// from the checkpoint), gradient clipping, how a step is executed (device, precision and loss
    /// scaling, remat, pipeline, ZeRO, kernels, TF32 / Triton, chunked loss, the LoRA base's
    /// dtype), how it evaluates, samples, keeps checkpoints and reports, and where it writes
    /// (`out_dir`: another directory forks the run) and caches data.
    may_change,
    /// Fixed by the run: what it trains (the model's architecture and shape, its
    /// initialisation, the LoRA settings), how (the optimiser, whose state the checkpoint
    /// holds, and the objective with its options), on what data and in what batches (data, its
    /// order and split, seed, batch size, accumulation). A resumed run given another value is
    /// refused before anything is loaded or written, naming each field with both values.
    fixed,
}

/// A field that differs between two configs ([`TrainConfig::changed_fields`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ChangedField {
    /// The field's name (its `--kebab-case` flag is this with `-` for `_`).
    pub name: &'static str,
    /// Whether a resumed run may change it.
    pub class: OnResume,
    /// The first config's value, as JSON.
    pub old: String,
    /// The second config's value, as JSON.
    pub new: String,
}

mod erased_json {
    /// A field's value as JSON (its Debug form should serialisation fail).
    pub trait Show {
        fn show(&self) -> String;
    }

    impl<T: serde::Serialize + std::fmt::Debug> Show for T {
        fn show(&self) -> String {
            serde_json::to_string(self).unwrap_or_else(|_| format!("{self:?}"))
        }
    }
}

// The defaults train the embedded 2-digit addition task to ~100% exact-match accuracy on
// held-out problems in 600 steps (about 30 s on 2 CPU cores): one problem per row
// (block_size = 3 * digits + 3 covers `ab+cd=` and the reversed 3-digit sum), batch 128.
// 3 layers at lr 2e-3 learn the carries from every seed tried (1337, 1, 2, 3, 4); 2 layers at
// 3e-3 sometimes stall at loss ~0.58 (~9% accuracy: carries not learned), depending on
// rounding and seed.
train_config! {
    /// Run directory: checkpoints, metrics.jsonl, loss.svg.
    #[resume(may_change)]
    out_dir: PathBuf = PathBuf::from("runs/addition"),
    /// Seed of initialisation, data sampling and dropout.
    #[resume(fixed)]
    seed: u64 = 1337,
    /// Device: `cpu`, `cuda`, `cuda:N` or `metal` (GPU ones need the matching cargo feature).
    #[resume(may_change)]
    device: DeviceSpec = DeviceSpec::Cpu,
    /// Data source: `addition` (embedded, no file), `char`, `byte`, `tokenizer`, `sft`
    /// (supervised fine-tuning records, JSONL or Parquet), `chat-task` (generated chats, no file) or
    /// `shards` (a directory `trainer prepare` wrote, or nanoGPT's train.bin/val.bin;
    /// memory-mapped).
    #[resume(fixed)]
    data: DataKind = DataKind::Addition,
    /// Text corpus for `char`, `byte` and `tokenizer` data; the JSONL or Parquet records for
    /// `sft`; the shard directory for `shards`.
    #[resume(fixed)]
    data_path: Option<PathBuf> = None,
    /// Order of the training windows of text and shard data: `random` (windows anywhere,
    /// shards weighted by size) or `epoch` (one pass over non-overlapping windows per epoch,
    /// in a seeded order; data-parallel ranks read disjoint windows).
    #[resume(fixed)]
    data_order: DataOrder = DataOrder::Random,
    /// `shards`: rows of packed documents (positions restart and attention stays within each
    /// document; needs shards with document starts and a Llama-family model).
    #[resume(fixed)]
    doc_mask: bool = false,
    /// A Hugging Face `tokenizer.json` for `tokenizer` and `sft` data (default: the
    /// init_from model's); `sft` reads the chat template and special tokens beside it
    /// (chat_template.jinja, tokenizer_config.json).
    #[resume(fixed)]
    tokenizer_path: Option<PathBuf> = None,
    /// `sft`: pack several examples into each row (positions restart, attention stays within
    /// an example) instead of one right-padded example a row.
    #[resume(fixed)]
    packing: bool = true,
    /// `sft`: only assistant turns / completions count in the loss (false: every token).
    #[resume(fixed)]
    completion_only: bool = true,
    /// `chat-task`: the generated task, `after-each` (the letter after each letter of a
    /// string) or `basics` (copying strings, the letter after / before one letter: what
    /// data/chat-base was pretrained on).
    #[resume(fixed)]
    chat_task: ChatTaskKind = ChatTaskKind::AfterEach,
    /// `chat-task`: number of generated conversations (both splits).
    #[resume(fixed)]
    chat_examples: usize = crate::data::chat_task::DEFAULT_EXAMPLES,
    /// Fraction of the corpus held out for validation (the end of the file).
    #[resume(fixed)]
    val_fraction: f32 = 0.1,
    /// Where tokenised corpora are cached (default: `$XDG_CACHE_HOME/candle-train`, else
    /// `~/.cache/candle-train`).
    #[resume(may_change)]
    cache_dir: Option<PathBuf> = None,
    /// Digits per operand of the embedded addition task.
    #[resume(fixed)]
    digits: usize = 2,
    /// Start from pretrained weights: a directory with config.json + model.safetensors (a
    /// Hugging Face model or a trainer checkpoint), a trainer run directory (its latest
    /// checkpoint), or a Hugging Face model id found in the local hub cache (HF_HOME). Model
    /// shape options are then taken from its config; block_size (at most its n_positions) is
    /// the training context only, the model keeps all its positions.
    #[resume(fixed)]
    init_from: Option<String> = None,
    /// Architecture of a fresh model (without init_from): gpt2, llama, mistral, qwen2, qwen3
    /// or gemma3_text, shaped by the fields below.
    #[resume(fixed)]
    arch: Arch = Arch::Gpt2,
    /// A Hugging Face config.json to build a fresh model from instead (any known
    /// architecture; its vocab_size must cover the data's token ids).
    #[resume(fixed)]
    model_json: Option<PathBuf> = None,
    /// Transformer blocks.
    #[resume(fixed)]
    n_layer: usize = 3,
    /// Attention heads.
    #[resume(fixed)]
    n_head: usize = 4,
    /// Embedding width.
    #[resume(fixed)]
    n_embd: usize = 128,
    /// Context length.
    #[resume(fixed)]
    block_size: usize = 9,
    /// Dropout probability.
    #[resume(fixed)]
    dropout: f32 = 0.0,
    /// Biases in linear layers and LayerNorms (Llama family: the attention's and the MLP's
    /// projections; Qwen2 always has q, k, v biases).
    #[resume(fixed)]
    bias: bool = true,
    /// Key/value heads of a fresh Llama-family model (0: as many as n_head); must divide
    /// n_head.
    #[resume(fixed)]
    n_kv_head: usize = 0,
    /// Width of a fresh Llama-family model's SwiGLU MLP (0: 8/3 n_embd rounded up to a
    /// multiple of 64).
    #[resume(fixed)]
    mlp_hidden: usize = 0,
    /// RoPE base of a fresh Llama-family model.
    #[resume(fixed)]
    rope_theta: f64 = 10000.0,
    /// Whether a fresh Llama-family model's head reads the token embedding (GPT-2's always
    /// does).
    #[resume(fixed)]
    tie_embeddings: bool = true,
    /// Sequences per micro-batch.
    #[resume(fixed)]
    batch_size: usize = 128,
    /// Micro-batches accumulated per optimiser step (each micro-batch's mean loss weighted
    /// 1/grad_accum, nanoGPT's convention).
    #[resume(fixed)]
    grad_accum: usize = 1,
    /// The training loss: `cross-entropy` (next-token cross-entropy, the token mean over the
    /// counted targets) or `dpo` (direct preference optimisation over `data = preference`
    /// pairs, TRL's `DPOTrainer`; its options are the `dpo_*` keys). A program can plug in its
    /// own (`Trainer::objective`).
    #[resume(fixed)]
    objective: String = "cross-entropy".into(),
    /// Options of the objective that reads them (a table: `[objective_options]`; on the
    /// command line `key=value,...`); the built-in ones take none.
    #[resume(fixed)]
    objective_options: Options = Options::default(),
    /// `objective = dpo`: the loss, `sigmoid`, `ipo` or `robust` (TRL's `loss_type`).
    #[resume(fixed)]
    dpo_loss: String = "sigmoid".into(),
    /// `objective = dpo`: β, how far the policy may move from the reference (TRL's `beta`).
    #[resume(fixed)]
    dpo_beta: f64 = 0.1,
    /// `objective = dpo`, `dpo_loss = robust`: the assumed share of flipped labels, in
    /// [0, 0.5) (TRL's `label_smoothing`).
    #[resume(fixed)]
    dpo_label_smoothing: f64 = 0.0,
    /// `objective = dpo`: compute the reference values once before training with the initial
    /// model and keep them in the run directory (TRL's `precompute_ref_log_probs`): how full
    /// fine-tuning gets its reference without holding a second model.
    #[resume(fixed)]
    dpo_precompute_ref: bool = false,
    /// The optimiser: `adamw` (decoupled weight decay; its options are `lr`, `beta1`,
    /// `beta2` and `weight_decay`) or `sgd` (PyTorch's `SGD`: `lr` and its
    /// `optimizer_options` `momentum`, `dampening`, `nesterov` and `weight_decay`).
    #[resume(fixed)]
    optimizer: String = "adamw".into(),
    /// Options of the optimiser that reads them (a table: `[optimizer_options]`; on the
    /// command line `key=value,...`, e.g. `momentum=0.9,nesterov=true`).
    #[resume(may_change)]
    optimizer_options: Options = Options::default(),
    /// Optimiser steps in the run.
    #[resume(may_change)]
    max_iters: usize = 600,
    /// Peak learning rate.
    #[resume(may_change)]
    lr: f64 = 3e-3,
    /// Final learning rate of the cosine decay.
    #[resume(may_change)]
    min_lr: f64 = 1e-4,
    /// Linear warm-up steps.
    #[resume(may_change)]
    warmup_iters: usize = 50,
    /// Step at which the cosine decay reaches min_lr (default: max_iters).
    #[resume(may_change)]
    lr_decay_iters: Option<usize> = None,
    /// `optimizer = adamw`: decoupled weight decay (2-D weights only).
    #[resume(may_change)]
    weight_decay: f64 = 0.1,
    /// `optimizer = adamw`: beta1.
    #[resume(may_change)]
    beta1: f64 = 0.9,
    /// `optimizer = adamw`: beta2.
    #[resume(may_change)]
    beta2: f64 = 0.99,
    /// Activation checkpointing of the blocks: none, all, every:K, sqrt or budget:BYTES
    /// (e.g. budget:256MiB; planned from an estimate of each block's activation bytes).
    #[resume(may_change)]
    remat: Policy = Policy::None,
    /// Compute dtype: f32, or f16/bf16 with f32 master weights and optimiser state.
    #[resume(may_change)]
    dtype: Precision = Precision::F32,
    /// Loss scaling for f16/bf16: auto (dynamic for f16, none for bf16), dynamic, none, or a
    /// static scale.
    #[resume(may_change)]
    loss_scale: LossScale = LossScale::Auto,
    /// Pipeline parallelism: number of stages (threads or devices) the model is cut into
    /// (1: off).
    #[resume(may_change)]
    pipeline_stages: usize = 1,
    /// Pipeline microbatches each micro-batch is split into.
    #[resume(may_change)]
    microbatches: usize = 4,
    /// Pipeline schedule: gpipe, 1f1b or interleaved:V.
    #[resume(may_change)]
    schedule: ScheduleKind = ScheduleKind::OneFOneB,
    /// CPU threads per pipeline stage (0: cores / stages).
    #[resume(may_change)]
    pipeline_threads: usize = 0,
    /// Device of each pipeline stage, comma-separated (`cpu,cpu`, `cuda:0,cuda:1`; empty:
    /// every stage on `device`). Weights stay on `device` and are copied to a stage's device
    /// at use, differentiably.
    #[resume(may_change)]
    pipeline_devices: DeviceList = DeviceList::default(),
    /// ZeRO stage with data parallelism: 0 (every rank keeps the whole optimiser state) or 1
    /// (the optimiser state and update are sharded across ranks, updated weights are
    /// all-gathered).
    #[resume(may_change)]
    zero: usize = 0,
    /// Op implementations: `fused` (candle-fused kernels) or `reference` (the composite Candle
    /// ops, for debugging and comparison).
    #[resume(may_change)]
    kernels: Kernels = Kernels::Fused,
    /// CUDA: f32 matmuls in TF32 (inputs rounded to 10-bit mantissas, f32 accumulation), as
    /// nanoGPT sets `torch.backends.cuda.matmul.allow_tf32`; false: full f32 matmuls. No
    /// effect on the CPU, nor on bf16/f16 matmuls.
    #[resume(may_change)]
    tf32: bool = true,
    /// CUDA: run candle-fused's Triton kernels (compiled ahead of time, verified on the CPU
    /// against its CPU kernels) instead of the composite Candle ops where one exists: `true`
    /// or `false`; unset, the environment decides (CANDLE_FUSED_TRITON=1 or 0), else
    /// candle-fused's default (on: compute capability 8.x and 9.0; other GPUs take the
    /// composite path). No effect on the CPU.
    #[resume(may_change)]
    triton_kernels: Option<bool> = None,
    /// Compute the head's cross-entropy a chunk of rows at a time, never holding the whole
    /// [batch, block, vocab] logits (every family; false: the whole logits, for comparison).
    #[resume(may_change)]
    chunked_loss: bool = true,
    /// Peak FLOP/s of the device for the MFU in logs (0: measure a matmul ceiling at start-up);
    /// raised to any rate a step reaches, so that MFU never exceeds 100%.
    #[resume(may_change)]
    peak_flops: f64 = 0.0,
    /// Clip the global gradient norm to this value (0 disables).
    #[resume(may_change)]
    grad_clip: f32 = 1.0,
    /// Evaluate (and checkpoint) every this many steps.
    #[resume(may_change)]
    eval_interval: usize = 100,
    /// Batches averaged per evaluation loss.
    #[resume(may_change)]
    eval_iters: usize = 5,
    /// Held-out problems scored per evaluation (tasks with a score only).
    #[resume(may_change)]
    eval_problems: usize = 500,
    /// Checkpoints kept besides the best one.
    #[resume(may_change)]
    keep_last: usize = 2,
    /// Tokens sampled at each evaluation (0: none; at most 65536).
    #[resume(may_change)]
    sample_tokens: usize = 0,
    /// LoRA rank: train low-rank adapters on a frozen --init-from model (0: train every
    /// weight).
    #[resume(fixed)]
    lora_r: usize = 0,
    /// LoRA alpha: the adapters' output is scaled by alpha / r (alpha / sqrt(r) with rslora).
    #[resume(fixed)]
    lora_alpha: f64 = 16.0,
    /// Dropout on the adapters' input.
    #[resume(fixed)]
    lora_dropout: f32 = 0.0,
    /// Linear layers that get an adapter: all-linear (every one but lm_head), module names
    /// separated by commas (q_proj,v_proj: a path equal to one or ending in .name), or
    /// re:REGEX matching the whole module path.
    #[resume(fixed)]
    lora_targets: TargetModules = TargetModules::AllLinear,
    /// rsLoRA scaling, alpha / sqrt(r).
    #[resume(fixed)]
    rslora: bool = false,
    /// Modules trained in full beside the adapters and saved with them (e.g. lm_head),
    /// comma-separated.
    #[resume(fixed)]
    modules_to_save: ModuleList = ModuleList::default(),
    /// Dtype the frozen base weights of a LoRA run are kept in (default: the compute dtype).
    #[resume(may_change)]
    base_dtype: Option<Precision> = None,
    /// Hold the frozen base's linear layers in 4 bits: nf4 quantizes each on load as
    /// bitsandbytes does (QLoRA; lm_head kept in --base-dtype); none keeps them as they are.
    #[resume(fixed)]
    base_quant: BaseQuant = BaseQuant::None,
    /// With --base-quant nf4: quantize the 4-bit blocks' scales again (bitsandbytes'
    /// bnb_4bit_use_double_quant).
    #[resume(fixed)]
    base_quant_double: bool = false,
    /// With --base-quant nf4: modules kept in --base-dtype (transformers'
    /// llm_int8_skip_modules), comma-separated: a layer whose module path holds one of these
    /// as whole components (lm_head, mlp.down_proj); empty quantizes every linear layer.
    #[resume(fixed)]
    base_quant_skip: ModuleList = ModuleList(vec![crate::lora::OUTPUT_HEAD.to_string()]),
    /// With a 4-bit base: the dtype its weights are dequantized into and its projections
    /// compute in (bitsandbytes' bnb_4bit_compute_dtype; the adapters compute in --dtype).
    /// Default: a saved 4-bit model's bnb_4bit_compute_dtype, else --base-dtype.
    #[resume(fixed)]
    base_compute_dtype: Option<Precision> = None,
    /// Start the LoRA adapters from a PEFT adapter directory (adapter_config.json +
    /// adapter_model.safetensors; its config replaces the lora_* settings).
    #[resume(fixed)]
    adapter: Option<PathBuf> = None,
    /// Use --adapter even though its file records another base model than --init-from (a
    /// warning names both; without this it is refused).
    #[resume(fixed)]
    other_base: bool = false,
}

impl TrainConfig {
    /// Reads a TOML file of config fields (unknown keys are an error naming the file).
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        Self::from_toml_file_with_keys(path).map(|(c, _)| c)
    }

    /// Reads a TOML file of config fields, and the names of the fields it sets (the rest keep
    /// their defaults).
    pub fn from_toml_file_with_keys(path: &Path) -> Result<(Self, Vec<String>)> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let bad = |e: toml::de::Error| Error::Config(format!("{}: {e}", path.display()));
        let table: toml::Table = toml::from_str(&text).map_err(bad)?;
        let keys = table.keys().cloned().collect();
        let config = table.try_into().map_err(bad)?;
        Ok((config, keys))
    }

    /// The config as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_default()
    }

    /// The model shape, with `vocab_size` from the data.
    pub fn gpt_config(&self, vocab_size: usize) -> GptConfig {
        GptConfig::fresh(&self.model_dims(vocab_size), self.dropout)
    }

    /// The run's model dimensions as it sets them (`n_kv_head` and `mlp_hidden` 0: the
    /// architecture's default), with `vocab_size` from the data.
    fn model_dims(&self, vocab_size: usize) -> Dims {
        Dims {
            layers: self.n_layer,
            hidden: self.n_embd,
            heads: self.n_head,
            kv_heads: self.n_kv_head,
            head_dim: 0,
            mlp: self.mlp_hidden,
            vocab: vocab_size,
            positions: self.block_size,
            tied: self.tie_embeddings,
            bias: self.bias,
        }
    }

    /// The data this run trains on.
    pub fn data_spec(&self) -> DataSpec {
        DataSpec {
            kind: self.data,
            path: self.data_path.clone(),
            tokenizer: self.tokenizer_path.clone(),
            val_fraction: self.val_fraction,
            cache_dir: self.cache_dir.clone(),
            digits: self.digits,
            seed: self.seed,
            packing: self.packing,
            completion_only: self.completion_only,
            chat_task: self.chat_task,
            chat_examples: self.chat_examples,
            order: self.data_order,
            doc_mask: self.doc_mask,
        }
    }

    /// Opens the run's data ([`TrainConfig::data_spec`]), checked to serve its blocks.
    pub fn open_data(&self) -> Result<Box<dyn DataSource>> {
        Ok(crate::data::open_for_run(
            &self.data_spec(),
            self.block_size,
        )?)
    }

    /// The configuration of a fresh model for this run, with `vocab_size` from the data:
    /// `model_json` when given (its own vocabulary, which must embed the data's), else `arch`
    /// shaped by `n_layer` / `n_head` / `n_embd` / `bias` (and, for the Llama family,
    /// `n_kv_head` / `mlp_hidden` / `rope_theta` / `tie_embeddings`), with `block_size`
    /// positions.
    pub fn model_config(&self, vocab_size: usize) -> Result<Box<dyn ModelConfig>> {
        if let Some(path) = &self.model_json {
            return Ok(crate::model::config_from_hf_json_file(path)?);
        }
        let dims = self.model_dims(vocab_size);
        Ok(self
            .arch
            .architecture()
            .fresh(&dims, self.dropout, self.rope_theta)?)
    }
}
