//! Subcommands over a saved model: `sample`, `eval` and `inspect`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::Device;
use clap::Args;
use rand::SeedableRng;
use trainer::checkpoint::{self, TrainerState};
use trainer::data::sft::SftEncoder;
use trainer::load::{
    Checks, DataCheck, FingerprintCheck, Loaded, ModelDir, Vocabulary, WeightFiles,
};
use trainer::model::ModelConfig;
use trainer::pretrained::{EvalRequest, TokenizerFile};
use trainer::sample::{generate_streaming, SamplingConfig};

/// The `sample` flags.
#[derive(Args, Debug)]
pub(super) struct SampleArgs {
    /// A run or checkpoint directory, a Hugging Face model directory, or a hub model id.
    model: String,
    /// A tokenizer.json to encode the prompt and decode the samples with.
    #[arg(long)]
    tokenizer_path: Option<PathBuf>,
    /// Text to continue (if it encodes to no token: the model's bos token, else id 0); with
    /// --chat, the user's message.
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Token ids to continue instead of --prompt, comma-separated (e.g. 15496,11), each below
    /// the model's vocab_size.
    #[arg(long, value_name = "IDS", value_delimiter = ',', conflicts_with_all = ["prompt", "chat"])]
    prompt_ids: Option<Vec<u32>>,
    /// Do not end at the model's end tokens (nor at a chat's end of turn): generate
    /// --max-new-tokens tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Draw only ids the tokenizer has (by default every id of the model's vocabulary, as
    /// transformers does; an id the tokenizer cannot decode is printed as <id:N>).
    #[arg(long)]
    tokenizer_ids_only: bool,
    /// Chat with the model: --prompt is a user message, rendered with the model's chat
    /// template (chat_template.jinja or tokenizer_config.json beside its tokenizer) and its
    /// generation prompt; the reply alone is printed, ending at the template's end-of-turn
    /// token or the model's end tokens.
    #[arg(long)]
    chat: bool,
    /// With --chat: a system message before the user's.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Tokens to generate. Past the model's positions, rotary ones (Llama family) go on (a
    /// warning: it was not trained there); GPT-2's learned ones see the last n_positions
    /// tokens afresh.
    #[arg(long, default_value_t = 200)]
    max_new_tokens: usize,
    /// Softmax temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample among the k most likely tokens only.
    #[arg(long, default_value_t = 200)]
    top_k: usize,
    /// Sample among the most likely tokens holding this much probability only (nucleus
    /// sampling; 1: off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Number of samples.
    #[arg(long, default_value_t = 1)]
    num_samples: usize,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Device (cpu, cuda, cuda:N, metal).
    #[arg(long, default_value = "cpu")]
    device: trainer::config::DeviceSpec,
    /// Use adapters even though they record another base model than the one found (a
    /// warning names both; without it they are refused).
    #[arg(long)]
    other_base: bool,
    /// The base model of adapters, instead of the one they name (a PEFT adapter's
    /// base_model_name_or_path, a LoRA run's init_from).
    #[arg(long, value_name = "MODEL")]
    init_from: Option<String>,
}

/// The `eval` flags.
#[derive(Args, Debug)]
pub(super) struct EvalArgs {
    /// A run or checkpoint directory, a Hugging Face model directory, or a hub model id.
    model: String,
    /// Use adapters even though they record another base model than the one found (a
    /// warning names both; without it they are refused).
    #[arg(long)]
    other_base: bool,
    /// The base model of adapters, instead of the one they name (a PEFT adapter's
    /// base_model_name_or_path, a LoRA run's init_from).
    #[arg(long, value_name = "MODEL")]
    init_from: Option<String>,
    #[command(flatten)]
    request: EvalRequest,
}

/// The `inspect` flags.
#[derive(Args, Debug)]
pub(super) struct InspectArgs {
    /// A run or checkpoint directory, a Hugging Face model directory, a hub model id, or a
    /// `.safetensors` file. Exits non-zero when the weights do not match config.json.
    checkpoint: String,
    /// Use adapters even though they record another base model than the one found (a
    /// warning names both; without it they are refused).
    #[arg(long)]
    other_base: bool,
    /// The base model of adapters, instead of the one they name (a PEFT adapter's
    /// base_model_name_or_path, a LoRA run's init_from).
    #[arg(long, value_name = "MODEL")]
    init_from: Option<String>,
}

/// How `sample` turns text into tokens and back.
enum Codec {
    /// A run's data source (trainer checkpoints).
    Data(Box<dyn trainer::data::DataSource>),
    /// A tokenizer.json.
    Tokenizer(Box<TokenizerFile>),
}

impl Codec {
    /// `--tokenizer-path`, else the run's data, else the model directory's tokenizer.json.
    fn for_model(model: &ModelDir, tokenizer: Option<&Path>) -> Result<Self> {
        if let Some(path) = tokenizer {
            return Ok(Codec::Tokenizer(Box::new(TokenizerFile::open(path)?)));
        }
        if let Some(run) = TrainerState::of(model)?.map(|s| s.config) {
            // Its fingerprint is checked against the run's when the model is loaded.
            let data = run.open_data().with_context(|| {
                format!(
                    "cannot open the data of the run of {} to encode the prompt (or give \
                     --tokenizer-path)",
                    model.dir.display()
                )
            })?;
            return Ok(Codec::Data(data));
        }
        Ok(Codec::Tokenizer(Box::new(model.tokenizer()?)))
    }

    fn encode(&self, text: &str) -> trainer::Result<Vec<u32>> {
        Ok(match self {
            Codec::Data(d) => d.encode(text)?,
            Codec::Tokenizer(t) => t.encode(text)?,
        })
    }

    fn vocab_size(&self) -> usize {
        match self {
            Codec::Data(d) => d.vocab_size(),
            Codec::Tokenizer(t) => t.vocab_size(),
        }
    }

    /// The text of `ids`; an id past the vocabulary (a model's padded embedding rows) is
    /// shown as `<id:N>`.
    fn decode(&self, ids: &[u32]) -> trainer::Result<String> {
        let known = self.vocab_size();
        let mut text = String::new();
        for run in ids.chunk_by(|a, b| (*a as usize) < known && (*b as usize) < known) {
            match run {
                [id] if *id as usize >= known => text.push_str(&format!("<id:{id}>")),
                run => text.push_str(&match self {
                    Codec::Data(d) => d.decode(run)?,
                    Codec::Tokenizer(t) => t.decode(run)?,
                }),
            }
        }
        Ok(text)
    }
}

pub(super) fn sample(args: SampleArgs) -> Result<()> {
    let model_dir = ModelDir::open_over(&args.model, args.init_from.as_deref())?
        .with_other_base(args.other_base);
    let device = args.device.open()?;
    let codec = Codec::for_model(&model_dir, args.tokenizer_path.as_deref())?;
    let loaded = load_for(&codec, &model_dir, &device)?;
    // Generation ends at any of the model's end tokens (generation_config.json, config.json).
    let mut stop = model_dir.eos_token_ids(loaded.config.as_ref())?;
    let model = loaded.build()?;
    let prompt = prompt_tokens(&args, &model_dir, &codec, model.config(), &mut stop)?;
    if args.ignore_eos {
        stop.clear();
    }
    warn_past_positions(prompt.len(), args.max_new_tokens, model.config());
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", args.top_p);
    }
    let sampling = SamplingConfig {
        temperature: args.temperature,
        top_k: Some(args.top_k),
        top_p: args.top_p,
        vocab: args.tokenizer_ids_only.then_some(codec.vocab_size()),
        ..SamplingConfig::default()
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    for i in 0..args.num_samples {
        if i > 0 && !crate::term::stdout_open("---------------\n") {
            return Ok(());
        }
        // Streamed as it is generated; a closed stdout (`sample | head -1`) ends it. A chat
        // prints the reply alone.
        let reply = args.chat.then_some(prompt.len());
        let mut stream = TextStream::default();
        let mut go_on = |tokens: &[u32]| stream.show(&codec, shown(tokens, reply, &stop), false);
        let out = generate_streaming(
            model.as_ref(),
            &prompt,
            args.max_new_tokens,
            sampling,
            &stop,
            &mut rng,
            &device,
            &mut go_on,
        )?;
        // Decoding errors are reported here (the stream skips what it cannot decode).
        codec.decode(shown(&out, reply, &stop))?;
        if !(stream.show(&codec, shown(&out, reply, &stop), true) && crate::term::stdout_open("\n"))
        {
            return Ok(());
        }
    }
    Ok(())
}

/// The model of `model_dir` on `device`, its vocabulary checked against `codec`'s.
///
/// More ids than the model embeds cannot be its own and are refused (a run's data must also
/// be the run's vocabulary). One with fewer (a model's padded embedding) is sampled over all
/// the model's ids (those past the tokenizer shown as <id:N>) unless --tokenizer-ids-only.
fn load_for(codec: &Codec, model_dir: &ModelDir, device: &Device) -> Result<Loaded> {
    let name = match codec {
        Codec::Tokenizer(t) => format!(
            "the tokenizer {} (used to encode the prompt)",
            t.path().display()
        ),
        Codec::Data(_) => String::new(),
    };
    let fingerprint = match codec {
        Codec::Tokenizer(t) => Some(t.vocab_fingerprint()),
        Codec::Data(_) => None,
    };
    let checks = match codec {
        Codec::Data(d) => Checks {
            data: Some(DataCheck {
                source: d.as_ref(),
                fingerprint: FingerprintCheck::Vocabulary,
            }),
            ..Checks::default()
        },
        Codec::Tokenizer(_) => Checks {
            vocab: Some(Vocabulary {
                name: &name,
                ids: codec.vocab_size(),
                fingerprint: fingerprint.as_deref(),
                advice: ": give the model's own tokenizer with --tokenizer-path",
            }),
            ..Checks::default()
        },
    };
    Ok(model_dir.load_with(&checks, device)?)
}

/// The prompt's token ids: `--prompt-ids`, else the prompt's text (a chat's rendered
/// conversation, adding its end of turn to `stop`) encoded; the model's bos token (else id 0)
/// when that is empty.
fn prompt_tokens(
    args: &SampleArgs,
    model_dir: &ModelDir,
    codec: &Codec,
    config: &dyn ModelConfig,
    stop: &mut Vec<u32>,
) -> Result<Vec<u32>> {
    let text = prompt_text(args, model_dir, stop)?;
    let prompt = match &args.prompt_ids {
        Some(ids) => prompt_ids(ids, config)?,
        None => codec
            .encode(&text)
            .with_context(|| format!("cannot encode the prompt {text:?}"))?,
    };
    Ok(if prompt.is_empty() {
        vec![config.special_tokens().bos.unwrap_or(0)]
    } else {
        prompt
    })
}

/// A warning when the prompt and the tokens to generate go past a rotary model's positions
/// (a model with learned positions slides its window instead).
fn warn_past_positions(prompt: usize, max_new_tokens: usize, config: &dyn ModelConfig) {
    let positions = config.max_positions();
    if prompt + max_new_tokens <= positions {
        return;
    }
    if trainer::sample::has_learned_positions(config) {
        // transformers refuses (its position embedding has no row past the last); nanoGPT
        // crops the context, which this keeps so that short GPTs still sample at length.
        tracing::warn!(
            "the prompt ({prompt}) and --max-new-tokens ({max_new_tokens}) go past the \
             model.s {positions} learned positions: past them each token sees only the last \
             {positions} (nanoGPT's crop; transformers would refuse)",
        );
    } else {
        tracing::warn!(
            "the prompt ({prompt}) and --max-new-tokens ({max_new_tokens}) go past the \
             model's {positions} positions: rotary positions continue there (as transformers \
             does), but the model was not trained that far",
        );
    }
}

/// `--prompt-ids`, checked against the model's vocabulary.
fn prompt_ids(ids: &[u32], config: &dyn ModelConfig) -> Result<Vec<u32>> {
    let vocab = config.vocab_size();
    if let Some(id) = ids.iter().find(|&&id| id as usize >= vocab) {
        bail!("--prompt-ids: id {id} is not below the model's vocab_size {vocab}");
    }
    Ok(ids.to_vec())
}

/// What of a sample's `tokens` is printed: all of them, or in a chat (`reply`: where the
/// reply starts) the reply without the token that ended it.
fn shown<'a>(tokens: &'a [u32], reply: Option<usize>, stop: &[u32]) -> &'a [u32] {
    let Some(start) = reply else {
        return tokens;
    };
    let reply = &tokens[start.min(tokens.len())..];
    match reply.split_last() {
        Some((last, rest)) if stop.contains(last) => rest,
        _ => reply,
    }
}

/// The text `sample` continues: `--prompt`, or with `--chat` the prompt as a user message of
/// the model's chat template (whose end-of-turn token then joins `stop`).
fn prompt_text(args: &SampleArgs, model: &ModelDir, stop: &mut Vec<u32>) -> Result<String> {
    if !args.chat {
        return Ok(args.prompt.clone());
    }
    let enc = chat_encoder(model, args.tokenizer_path.as_deref())?;
    stop.extend(enc.end_of_turn()?);
    Ok(enc.chat_prompt(args.system.as_deref(), &args.prompt)?)
}

/// The tokenizer and chat template `sample --chat` renders the prompt with: beside
/// `--tokenizer-path`, else the run's tokenizer, else the model's `tokenizer.json`.
fn chat_encoder(model: &ModelDir, tokenizer: Option<&Path>) -> Result<SftEncoder> {
    let path = match (tokenizer, model.run.as_ref().map(|s| &s.config)) {
        (Some(t), _) => t.to_path_buf(),
        (None, Some(run)) if run.tokenizer_path.is_some() => {
            run.tokenizer_path.clone().unwrap_or_default()
        }
        _ => model.dir.join(trainer::pretrained::TOKENIZER_FILE),
    };
    SftEncoder::open(&path).with_context(|| {
        format!(
            "--chat needs the model's chat template beside its tokenizer {}",
            path.display()
        )
    })
}

/// Prints a sample as it grows, decoding a short window of tokens each time (as
/// transformers' `TextStreamer`): the text of `tokens[prev..]` beyond that of
/// `tokens[prev..cur]`, once it is whole (no trailing partial character, unless `last`).
#[derive(Default)]
struct TextStream {
    prev: usize,
    cur: usize,
}

impl TextStream {
    /// Prints what `tokens` (the sample so far) add; false once stdout is closed.
    fn show(&mut self, codec: &Codec, tokens: &[u32], last: bool) -> bool {
        let cur = self.cur.min(tokens.len());
        let (Ok(before), Ok(text)) = (
            codec.decode(&tokens[self.prev.min(cur)..cur]),
            codec.decode(&tokens[self.prev.min(cur)..]),
        ) else {
            return true;
        };
        let Some(new) = text.strip_prefix(before.as_str()) else {
            return true; // the decoder changed printed text: wait for more
        };
        if new.is_empty() || (!last && new.ends_with('\u{FFFD}')) {
            return true;
        }
        (self.prev, self.cur) = (cur, tokens.len());
        crate::term::stdout_open(new)
    }
}

pub(super) fn eval(args: EvalArgs) -> Result<()> {
    let model = ModelDir::open_over(&args.model, args.init_from.as_deref())?
        .with_other_base(args.other_base);
    let e = args
        .request
        .evaluate(&model)
        .with_context(|| format!("cannot evaluate {}", model.dir.display()))?;
    outln!("step        {}", e.step);
    // Each loss as the shortest text that reads back as the same f32.
    outln!("train loss  {}", e.train_loss);
    outln!("val loss    {}", e.val_loss);
    if let (Some(s), Some(n)) = (e.score, &e.score_name) {
        outln!("{n}  {:.1}%", 100.0 * s);
    }
    Ok(())
}

pub(super) fn inspect(args: InspectArgs) -> Result<()> {
    let spec = &args.checkpoint;
    if Path::new(spec).is_file() {
        return print_tensors(&WeightFiles::Single(PathBuf::from(spec)));
    }
    let model =
        ModelDir::open_over(spec, args.init_from.as_deref())?.with_other_base(args.other_base);
    print_tensors(&model.weights)?;
    inspect_dir(&model)
}

/// Prints the name, shape and dtype of every tensor of `weights` (from the headers only) and
/// the totals.
fn print_tensors(weights: &WeightFiles) -> Result<()> {
    let mut headers = weights.headers()?;
    headers.sort_by(|a, b| a.name.cmp(&b.name));
    outln!("file        {}", weights.path().display());
    if let WeightFiles::Sharded(_) = weights {
        outln!("shards      {}", weights.files().len());
    }
    let mut total = 0usize;
    for h in &headers {
        total += h.shape.iter().product::<usize>();
        outln!(
            "  {:<44} {:<14} {}",
            h.name,
            format!("{:?}", h.shape),
            h.dtype
        );
    }
    outln!("tensors     {}", headers.len());
    outln!("parameters  {total} ({:.2}M)", total as f64 / 1e6);
    Ok(())
}

/// Prints the config, the loader's check and the trainer state of checkpoint or model
/// directory `model`; weights that do not match `config.json`, or a `config.json` that
/// disagrees with the run's recorded state, are an error (after the report).
fn inspect_dir(model: &ModelDir) -> Result<()> {
    let mut failed = None;
    if model.dir.join(checkpoint::CONFIG_FILE).is_file() {
        let cfg = model.config()?;
        let shape = cfg.shape();
        outln!(
            "config      {} n_layer {} n_head {} n_embd {} block_size {} vocab_size {} bias {}",
            cfg.architecture(),
            shape.n_layer,
            shape.n_head,
            shape.n_embd,
            cfg.max_positions(),
            cfg.vocab_size(),
            shape.bias
        );
        let ids = |t: &[u32]| match t {
            [] => "none".to_string(),
            t => t.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
        };
        let bos: Vec<u32> = cfg.special_tokens().bos.into_iter().collect();
        let eos = model.eos_token_ids(cfg.as_ref())?;
        outln!("special     bos {} eos {}", ids(&bos), ids(&eos));
        // The loader's checks: the run's recorded state first (config.json must be the run's
        // model), then the weights against config.json (Hugging Face names, mask buffers and a
        // tied lm_head accepted as they are when training), then the manifest.
        let checked = model.load_with(&Checks::default(), &candle_core::Device::Cpu);
        match checked {
            Ok(_) if model.run.is_some() => {
                outln!("check       weights match the config and the run")
            }
            Ok(_) => outln!("check       weights match the config"),
            Err(e) => {
                outln!("check       FAILED");
                failed = Some(e);
            }
        }
    }
    if let Some(state) = TrainerState::of(model)? {
        outln!("step        {}", state.step);
        outln!("tokens      {}", state.tokens_seen);
        if let Some(b) = state.best_val_loss {
            outln!(
                "best val    {b:.4} ({})",
                state.best_checkpoint.clone().unwrap_or_default()
            );
        }
        outln!("--- run config ---\n{}", state.config.to_toml());
    }
    failed.map_or(Ok(()), |e| Err(e.into()))
}
