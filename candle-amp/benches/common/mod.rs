//! A compact GPT and a training loop for the candle-amp bench (a model of the bench's own, so
//! that candle-amp's figures do not depend on the trainer).
//!
//! Only differentiable ops: a layer norm and softmax computed as [`Precision`] says, matmuls,
//! `index_select` embeddings, GELU. Initialisation is seeded on the host (SplitMix64 +
//! Box-Muller, so the root example needs no extra dependency) and uploaded, which makes
//! every mode start from the same f32 weights.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use candle_amp::{Amp, MasterWeights, Plain, ScaledUpdate, ScalerConfig, StepOutcome, WeightMode};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};

/// How the bench model computes: matmuls and elementwise ops in `compute`; softmax,
/// layer-norm statistics and the loss in f32 when `f32_islands` (mixed precision), or in
/// `compute` too (pure low precision, the naive baseline that diverges in f16).
#[derive(Debug, Clone, Copy)]
pub struct Precision {
    pub compute: DType,
    pub f32_islands: bool,
}

impl Precision {
    pub fn mixed(compute: DType) -> Self {
        Self {
            compute,
            f32_islands: true,
        }
    }

    pub fn pure(compute: DType) -> Self {
        Self {
            compute,
            f32_islands: false,
        }
    }

    pub fn full_f32() -> Self {
        Self::mixed(DType::F32)
    }

    fn up(&self, x: &Tensor) -> Result<Tensor> {
        if self.f32_islands {
            x.to_dtype(DType::F32)
        } else {
            Ok(x.clone())
        }
    }

    /// A (master) weight cast to the compute dtype (differentiable).
    fn weight(&self, w: &Tensor) -> Result<Tensor> {
        w.to_dtype(self.compute)
    }

    /// Softmax over `dim`, returned in `x`'s dtype.
    fn softmax(&self, x: &Tensor, dim: D) -> Result<Tensor> {
        candle_nn::ops::softmax(&self.up(x)?, dim)?.to_dtype(x.dtype())
    }

    /// `(x - mean) / sqrt(var + eps) * gamma + beta` over the last dimension, in `x`'s dtype.
    fn layer_norm(&self, x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f64) -> Result<Tensor> {
        let xs = self.up(x)?;
        let dt = xs.dtype();
        let mean = xs.mean_keepdim(D::Minus1)?;
        let xc = xs.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        let y = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
        let y = y.broadcast_mul(&gamma.to_dtype(dt)?)?;
        y.broadcast_add(&beta.to_dtype(dt)?)?.to_dtype(x.dtype())
    }

    /// Mean cross-entropy of `logits` `(N, C)` against `targets` `(N,)`.
    fn cross_entropy(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        candle_nn::loss::cross_entropy(&self.up(logits)?, targets)
    }
}

/// [`Plain`] that also times the overflow check (the gradient norm: one reduction, one
/// host sync).
struct Timed<'a, O> {
    inner: Plain<'a, O>,
    check: Duration,
}

impl<O: Optimizer> ScaledUpdate for Timed<'_, O> {
    type Error = candle_core::Error;

    fn grad_norm(&mut self, grads: &GradStore, vars: &[Var]) -> Result<f64> {
        let t0 = Instant::now();
        let norm = self.inner.grad_norm(grads, vars);
        self.check += t0.elapsed();
        norm
    }

    fn apply(&mut self, grads: &GradStore, vars: &[Var], coef: f64) -> Result<()> {
        self.inner.apply(grads, vars, coef)
    }
}

/// SplitMix64: a tiny seeded generator.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Model size.
#[derive(Debug, Clone, Copy)]
pub struct GptConfig {
    pub vocab: usize,
    pub block: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_layer: usize,
}

/// Parameters as named variables (sorted by name); the forward reads them through a
/// [`Precision`], so the same model runs in f32, mixed or pure low precision.
pub struct Gpt {
    pub cfg: GptConfig,
    pub params: Vec<(String, Var)>,
    mask: Tensor,
}

impl Gpt {
    /// Seeded init (GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2L),
    /// norms at 1/0), created in f32 and cast to `dtype`.
    pub fn new(cfg: GptConfig, seed: u64, dtype: DType, dev: &Device) -> Result<Self> {
        let mut rng = Rng::new(seed);
        let (c, v, t) = (cfg.n_embd, cfg.vocab, cfg.block);
        let mut specs: Vec<(String, Vec<usize>, f64)> = vec![
            ("wte".into(), vec![v, c], 0.02),
            ("wpe".into(), vec![t, c], 0.02),
            ("lnf.g".into(), vec![c], -1.0),
            ("lnf.b".into(), vec![c], 0.0),
            ("head".into(), vec![c, v], 0.02),
        ];
        let proj = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
        for l in 0..cfg.n_layer {
            let p = |s: &str| format!("h{l}.{s}");
            specs.extend([
                (p("ln1.g"), vec![c], -1.0),
                (p("ln1.b"), vec![c], 0.0),
                (p("qkv"), vec![c, 3 * c], 0.02),
                (p("proj"), vec![c, c], proj),
                (p("ln2.g"), vec![c], -1.0),
                (p("ln2.b"), vec![c], 0.0),
                (p("fc"), vec![c, 4 * c], 0.02),
                (p("fc_proj"), vec![4 * c, c], proj),
            ]);
        }
        let mut params = Vec::new();
        for (name, shape, std) in specs {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n)
                .map(|_| {
                    if std < 0.0 {
                        1.0
                    } else if std == 0.0 {
                        0.0
                    } else {
                        (rng.normal() * std) as f32
                    }
                })
                .collect();
            let t = Tensor::from_vec(data, shape, dev)?.to_dtype(dtype)?;
            params.push((name, Var::from_tensor(&t)?));
        }
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), dev)?;
        Ok(Self { cfg, params, mask })
    }

    /// The same architecture over other variables (e.g. compute copies).
    pub fn with_params(&self, params: Vec<(String, Var)>) -> Self {
        Self {
            cfg: self.cfg,
            params,
            mask: self.mask.clone(),
        }
    }

    pub fn vars(&self) -> Vec<Var> {
        self.params.iter().map(|p| p.1.clone()).collect()
    }

    fn w(&self, p: &Precision, name: &str) -> Result<Tensor> {
        let v = self
            .params
            .iter()
            .find(|x| x.0 == name)
            .ok_or_else(|| candle_core::Error::Msg(format!("no param {name}")))?;
        p.weight(v.1.as_tensor())
    }

    fn linear(&self, p: &Precision, x: &Tensor, name: &str) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let w = self.w(p, name)?;
        let out = w.dim(1)?;
        x.reshape((b * t, c))?.matmul(&w)?.reshape((b, t, out))
    }

    fn ln(&self, p: &Precision, x: &Tensor, name: &str) -> Result<Tensor> {
        let g = self.w(p, &format!("{name}.g"))?;
        let b = self.w(p, &format!("{name}.b"))?;
        p.layer_norm(x, &g, &b, 1e-5)
    }

    /// Mean next-token cross-entropy of `x` `(B, T)` u32 against `y` `(B, T)`.
    pub fn loss(&self, p: &Precision, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let cfg = self.cfg;
        let (b, t) = x.dims2()?;
        let (c, nh) = (cfg.n_embd, cfg.n_head);
        let hd = c / nh;
        let tok = self
            .w(p, "wte")?
            .index_select(&x.flatten_all()?, 0)?
            .reshape((b, t, c))?;
        let pos = self.w(p, "wpe")?.narrow(0, 0, t)?;
        let mut h = tok.broadcast_add(&pos)?;
        let mask = self
            .mask
            .narrow(0, 0, t)?
            .narrow(1, 0, t)?
            .to_dtype(h.dtype())?;
        for l in 0..cfg.n_layer {
            let a = self.ln(p, &h, &format!("h{l}.ln1"))?;
            let qkv = self.linear(p, &a, &format!("h{l}.qkv"))?;
            let heads = |i: usize| -> Result<Tensor> {
                qkv.narrow(2, i * c, c)?
                    .reshape((b, t, nh, hd))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
            let att = q.matmul(&k.t()?)?.affine(1.0 / (hd as f64).sqrt(), 0.0)?;
            let att = p.softmax(&att.broadcast_add(&mask)?, D::Minus1)?;
            let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
            h = (h + self.linear(p, &y, &format!("h{l}.proj"))?)?;
            let m = self.ln(p, &h, &format!("h{l}.ln2"))?;
            let m = self.linear(p, &m, &format!("h{l}.fc"))?.gelu()?;
            h = (h + self.linear(p, &m, &format!("h{l}.fc_proj"))?)?;
        }
        let h = self.ln(p, &h, "lnf")?;
        let logits = self.linear(p, &h, "head")?;
        p.cross_entropy(&logits.reshape((b * t, cfg.vocab))?, &y.flatten_all()?)
    }
}

/// Token data: tinyshakespeare (char level) if present, else a synthetic task.
pub struct Data {
    pub tokens: Vec<u32>,
    pub vocab: usize,
    pub source: String,
}

impl Data {
    /// Loads `path` as characters, or builds a deterministic synthetic sequence (a noisy
    /// counting task over 64 symbols) if it cannot be read.
    pub fn load(path: &std::path::Path) -> Self {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                let mut chars: Vec<char> = text.chars().collect();
                chars.sort_unstable();
                chars.dedup();
                let tokens = text
                    .chars()
                    .map(|ch| chars.binary_search(&ch).unwrap_or(0) as u32)
                    .collect();
                Self {
                    tokens,
                    vocab: chars.len(),
                    source: format!("{} (char-level)", path.display()),
                }
            }
            Err(_) => {
                let mut rng = Rng::new(1234);
                let mut tokens = Vec::with_capacity(200_000);
                let mut cur = 0u32;
                for _ in 0..200_000 {
                    cur = if rng.uniform() < 0.1 {
                        rng.below(64) as u32
                    } else {
                        (cur * 5 + 3) % 64
                    };
                    tokens.push(cur);
                }
                Self {
                    tokens,
                    vocab: 64,
                    source: format!("synthetic ({} not found)", path.display()),
                }
            }
        }
    }

    /// Batch `i` of the stream seeded by `seed`: inputs and next-token targets `(B, T)`.
    pub fn batch(
        &self,
        seed: u64,
        i: u64,
        b: usize,
        t: usize,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let mut rng = Rng::new(seed ^ i.wrapping_mul(0x9E37_79B9));
        let mut xs = Vec::with_capacity(b * t);
        let mut ys = Vec::with_capacity(b * t);
        for _ in 0..b {
            let s = rng.below(self.tokens.len() - t - 1);
            xs.extend_from_slice(&self.tokens[s..s + t]);
            ys.extend_from_slice(&self.tokens[s + 1..s + t + 1]);
        }
        Ok((
            Tensor::from_vec(xs, (b, t), dev)?,
            Tensor::from_vec(ys, (b, t), dev)?,
        ))
    }
}

/// How to train.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// f32 weights and compute, candle-nn AdamW (through `Amp` with scale 1 for clipping).
    F32,
    /// f32 masters, f16 compute, dynamic loss scaling (candle-amp).
    F16Amp,
    /// As `F16Amp` with separate f16 compute copies (`WeightMode::Copies`).
    F16AmpCopies,
    /// f32 masters, bf16 compute, no loss scaling (candle-amp).
    Bf16Amp,
    /// Everything f16 (weights, AdamW state, softmax, norms, loss), no crate.
    PureF16,
}

impl Mode {
    pub const ALL: [Mode; 5] = [
        Mode::F32,
        Mode::F16Amp,
        Mode::F16AmpCopies,
        Mode::Bf16Amp,
        Mode::PureF16,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mode::F32 => "f32",
            Mode::F16Amp => "f16 + amp",
            Mode::F16AmpCopies => "f16 + amp (copies)",
            Mode::Bf16Amp => "bf16 + amp",
            Mode::PureF16 => "pure f16",
        }
    }

    pub fn parse(s: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.name() == s)
    }
}

/// Training hyper-parameters.
#[derive(Debug, Clone, Copy)]
pub struct TrainConfig {
    pub gpt: GptConfig,
    pub batch: usize,
    pub steps: u64,
    pub lr: f64,
    /// Global-norm clipping of every mode except pure f16.
    pub clip: f64,
    pub seed: u64,
    pub eval_batches: u64,
    /// Steps excluded from the timing (warm-up, profiling).
    pub warmup: u64,
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct Report {
    pub mode: Mode,
    pub losses: Vec<f32>,
    /// Mean f32 loss of the trained weights on held-out batches (NaN if diverged).
    pub eval_loss: f32,
    pub step_time: Duration,
    pub check_time: Duration,
    pub skipped: u64,
    pub final_scale: f64,
    pub first_nonfinite: Option<u64>,
}

/// f32 evaluation of the (master) weights on fixed batches.
pub fn evaluate(model: &Gpt, data: &Data, tc: &TrainConfig, dev: &Device) -> Result<f32> {
    let p = Precision::full_f32();
    let mut total = 0.0;
    for i in 0..tc.eval_batches {
        let (x, y) = data.batch(tc.seed + 1_000_003, i, tc.batch, tc.gpt.block, dev)?;
        total += p_loss(model, &p, &x, &y)?;
    }
    Ok(total / tc.eval_batches as f32)
}

fn p_loss(model: &Gpt, p: &Precision, x: &Tensor, y: &Tensor) -> Result<f32> {
    model
        .loss(p, x, y)?
        .to_dtype(DType::F32)?
        .to_scalar::<f32>()
}

/// Trains one mode; `each` is called after every step with (step, loss, outcome).
/// Pure f16 stops after 5 non-finite losses (it has diverged).
pub fn train(
    mode: Mode,
    tc: &TrainConfig,
    data: &Data,
    dev: &Device,
    mut each: impl FnMut(u64, f32, Option<&StepOutcome>),
) -> anyhow::Result<Report> {
    let dtype = if mode == Mode::PureF16 {
        DType::F16
    } else {
        DType::F32
    };
    let model = Gpt::new(tc.gpt, tc.seed, dtype, dev)?;
    let policy = match mode {
        Mode::F32 => Precision::full_f32(),
        Mode::F16Amp | Mode::F16AmpCopies => Precision::mixed(DType::F16),
        Mode::Bf16Amp => Precision::mixed(DType::BF16),
        Mode::PureF16 => Precision::pure(DType::F16),
    };
    let params = ParamsAdamW {
        lr: tc.lr,
        weight_decay: 0.0,
        ..Default::default()
    };
    // f32 also goes through Amp (f32 compute, scale 1) so that every mode clips the same way;
    // tests/step.rs checks that Amp with f32 compute equals a plain f32 step.
    let wmode = if mode == Mode::F16AmpCopies {
        WeightMode::Copies
    } else {
        WeightMode::Cast
    };
    let mut amp = match mode {
        Mode::PureF16 => None,
        _ => {
            let mw = MasterWeights::new(model.params.clone(), policy.compute, wmode)?;
            let cfg = if matches!(mode, Mode::F16Amp | Mode::F16AmpCopies) {
                ScalerConfig::dynamic()
            } else {
                ScalerConfig::none()
            };
            Some(Amp::new(mw, cfg)?.with_clip_norm(Some(tc.clip))?)
        }
    };
    // In copies mode the forward runs on the f16 compute variables; the optimiser and the
    // evaluation use the f32 masters.
    let fwd = match &amp {
        Some(a) if wmode == WeightMode::Copies => {
            let w = a.weights();
            model.with_params(
                w.names()
                    .filter_map(|n| Some((n.to_string(), w.compute_var(n)?.clone())))
                    .collect(),
            )
        }
        _ => model.with_params(model.params.clone()),
    };
    let mut opt = AdamW::new(model.vars(), params)?;
    let mut losses = Vec::new();
    let (mut step_time, mut check_time) = (Duration::ZERO, Duration::ZERO);
    let mut first_nonfinite = None;
    let mut bad = 0;
    for i in 0..tc.steps {
        let (x, y) = data.batch(tc.seed, i, tc.batch, tc.gpt.block, dev)?;
        let t0 = Instant::now();
        let loss = fwd.loss(&policy, &x, &y)?;
        let outcome = match amp.as_mut() {
            Some(amp) => {
                let grads = amp.backward(&loss)?;
                let mut update = Timed {
                    inner: Plain(&mut opt),
                    check: Duration::ZERO,
                };
                let o = amp.step(&grads, &mut update)?;
                if i >= tc.warmup {
                    check_time += update.check;
                }
                Some(o)
            }
            None => {
                opt.backward_step(&loss)?;
                None
            }
        };
        let l = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        if i >= tc.warmup {
            step_time += t0.elapsed();
        }
        losses.push(l);
        each(i, l, outcome.as_ref());
        if !l.is_finite() {
            first_nonfinite.get_or_insert(i);
            bad += 1;
            if bad >= 5 {
                break;
            }
        }
    }
    let timed = (losses.len() as u32)
        .saturating_sub(tc.warmup as u32)
        .max(1);
    let eval_loss = if first_nonfinite.is_some() && mode == Mode::PureF16 {
        f32::NAN
    } else {
        evaluate(&model, data, tc, dev)?
    };
    Ok(Report {
        mode,
        losses,
        eval_loss,
        step_time: step_time / timed,
        check_time: check_time / timed,
        skipped: amp.as_ref().map_or(0, |a| a.state().skipped),
        final_scale: amp.as_ref().map_or(1.0, |a| a.scale()),
        first_nonfinite,
    })
}
