//! Subcommands over a saved model: `sample`, `eval` and `inspect`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use rand::SeedableRng;
use trainer::checkpoint::{self, TrainerState};
use trainer::pretrained::{ModelDir, TokenizerFile};
use trainer::sample::{generate, SamplingConfig};

use super::{EvalArgs, InspectArgs, SampleArgs};

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
        if let Some(run) = model.run_config() {
            let data = run.open_data().with_context(|| {
                format!(
                    "cannot open the data of the run of {} to encode the prompt (or give \
                     --tokenizer-path)",
                    model.dir.display()
                )
            })?;
            let state = model.run.as_ref().map(|r| r.data.as_ref());
            trainer::data::check_fingerprint(state.flatten(), data.as_ref(), &model.dir, false)?;
            return Ok(Codec::Data(data));
        }
        Ok(Codec::Tokenizer(Box::new(model.tokenizer()?)))
    }

    fn encode(&self, text: &str) -> trainer::Result<Vec<u32>> {
        match self {
            Codec::Data(d) => d.encode(text),
            Codec::Tokenizer(t) => t.encode(text),
        }
    }

    fn vocab_size(&self) -> usize {
        match self {
            Codec::Data(d) => d.vocab_size(),
            Codec::Tokenizer(t) => t.vocab_size(),
        }
    }

    fn decode(&self, ids: &[u32]) -> trainer::Result<String> {
        match self {
            Codec::Data(d) => d.decode(ids),
            Codec::Tokenizer(t) => t.decode(ids),
        }
    }
}

pub(super) fn sample(args: SampleArgs) -> Result<()> {
    let model_dir = ModelDir::open(&args.model)?;
    let device = args.device.open()?;
    let codec = Codec::for_model(&model_dir, args.tokenizer_path.as_deref())?;
    let model = model_dir.load_model(&device)?;
    // A vocabulary with more ids than the model embeds cannot be its own: refused, as `eval`
    // does. One with fewer (a model's padded embedding) is sampled within its ids only.
    let (ids, embedded) = (codec.vocab_size(), model.config().vocab_size());
    if ids > embedded {
        anyhow::bail!(
            "the vocabulary used to encode the prompt ({}) has {ids} token ids but the model in \
             {} embeds only {embedded}: give the model's own tokenizer with --tokenizer-path",
            args.tokenizer_path
                .as_ref()
                .map_or_else(|| "the run's data".to_string(), |p| p.display().to_string()),
            model_dir.dir.display()
        );
    }
    let prompt = codec
        .encode(&args.prompt)
        .with_context(|| format!("cannot encode the prompt {:?}", args.prompt))?;
    let prompt = if prompt.is_empty() {
        vec![model.config().special_tokens().bos.unwrap_or(0)]
    } else {
        prompt
    };
    let sampling = SamplingConfig {
        temperature: args.temperature,
        top_k: Some(args.top_k),
        vocab: Some(ids),
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    for i in 0..args.num_samples {
        let out = generate(
            model.as_ref(),
            &prompt,
            args.max_new_tokens,
            sampling,
            &mut rng,
            &device,
        )?;
        if i > 0 {
            println!("---------------");
        }
        println!("{}", codec.decode(&out)?);
    }
    Ok(())
}

pub(super) fn eval(args: EvalArgs) -> Result<()> {
    let model = ModelDir::open(&args.model)?;
    let e = args
        .request
        .evaluate(&model)
        .with_context(|| format!("cannot evaluate {}", model.dir.display()))?;
    println!("step        {}", e.step);
    println!("train loss  {:.4}", e.train_loss);
    println!("val loss    {:.4}", e.val_loss);
    if let (Some(s), Some(n)) = (e.score, &e.score_name) {
        println!("{n}  {:.1}%", 100.0 * s);
    }
    Ok(())
}

pub(super) fn inspect(args: InspectArgs) -> Result<()> {
    let spec = &args.checkpoint;
    let (model_file, dir) = if Path::new(spec).is_file() {
        (PathBuf::from(spec), None)
    } else {
        let dir = trainer::pretrained::resolve(spec)?;
        (dir.join(checkpoint::MODEL_FILE), Some(dir))
    };
    let loaded = checkpoint::io::load_safetensors(&model_file, &candle_core::Device::Cpu)?;
    let mut names: Vec<_> = loaded.tensors.keys().cloned().collect();
    names.sort();
    println!("file        {}", model_file.display());
    let mut total = 0usize;
    for n in &names {
        let t = &loaded.tensors[n];
        total += t.elem_count();
        println!(
            "  {n:<44} {:<14} {:?}",
            format!("{:?}", t.dims()),
            t.dtype()
        );
    }
    println!("tensors     {}", names.len());
    println!("parameters  {total} ({:.2}M)", total as f64 / 1e6);
    drop(loaded);
    if let Some(dir) = dir {
        inspect_dir(&dir, &model_file)?;
    }
    Ok(())
}

/// Prints the config, the weight check and the trainer state of checkpoint or model directory
/// `dir`; weights that do not match `config.json`, or a `config.json` that disagrees with the
/// run's recorded state, are an error (after the report).
fn inspect_dir(dir: &Path, model_file: &Path) -> Result<()> {
    let cfg_path = dir.join(checkpoint::CONFIG_FILE);
    let state_path = dir.join(checkpoint::STATE_FILE);
    let state: Option<TrainerState> = match state_path.is_file() {
        true => Some(checkpoint::io::read_json(&state_path)?),
        false => None,
    };
    let mut mismatch = None;
    if cfg_path.is_file() {
        let cfg = trainer::model::config_from_hf_json_file(&cfg_path)?;
        let shape = cfg.shape();
        println!(
            "config      {} n_layer {} n_head {} n_embd {} block_size {} vocab_size {} bias {}",
            cfg.architecture(),
            shape.n_layer,
            shape.n_head,
            shape.n_embd,
            cfg.max_positions(),
            cfg.vocab_size(),
            shape.bias
        );
        let id = |t: Option<u32>| t.map_or("none".to_string(), |t| t.to_string());
        let tokens = cfg.special_tokens();
        println!("special     bos {} eos {}", id(tokens.bos), id(tokens.eos));
        // The run's recorded state first (config.json must be the run's model), then the
        // loader's own check: Hugging Face names (no `transformer.` prefix, mask buffers, a
        // tied lm_head) are accepted as they are when training.
        let run = state.as_ref().map(|s| &s.config);
        let checked = run
            .map_or(Ok(()), |run| {
                checkpoint::check_model_matches(cfg.as_ref(), run, None, dir)
            })
            .map_err(anyhow::Error::new)
            .and_then(|()| {
                let source = match run {
                    Some(_) => checkpoint::Source::Checkpoint,
                    None => checkpoint::Source::Pretrained,
                };
                checkpoint::load_params(model_file, cfg.as_ref(), &candle_core::Device::Cpu, source)
                    .map_err(|e| {
                        anyhow::Error::new(e)
                            .context(format!("the weights do not match {}", cfg_path.display()))
                    })
            })
            .and_then(|_| match &state {
                // A trainer checkpoint is one unit (see `checkpoint::manifest`).
                Some(s) => Ok(checkpoint::manifest::verify(dir, s.step)?),
                None => Ok(()),
            });
        match checked {
            Ok(_) if run.is_some() => println!("check       weights match the config and the run"),
            Ok(_) => println!("check       weights match the config"),
            Err(e) => {
                println!("check       MISMATCH");
                mismatch = Some(e);
            }
        }
    }
    if let Some(state) = state {
        println!("step        {}", state.step);
        println!("tokens      {}", state.tokens_seen);
        if let Some(b) = state.best_val_loss {
            println!(
                "best val    {b:.4} ({})",
                state.best_checkpoint.unwrap_or_default()
            );
        }
        println!("--- run config ---\n{}", state.config.to_toml());
    }
    mismatch.map_or(Ok(()), Err)
}
