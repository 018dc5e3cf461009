//! LoRA fine-tuning: a model whose base weights are frozen (no gradient, no optimiser state,
//! optionally bf16) with [`candle_peft`] adapters on the linear layers its config targets.
//!
//! The trainable parameters are the adapters' `A` and `B` and the modules to save, named as
//! PEFT writes them on disk (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`,
//! `base_model.model.lm_head.weight`), so a checkpoint's adapter file is PEFT's
//! `adapter_model.safetensors` as it is. Everything else of the trainer (the step, the
//! executors, the optimiser, the loss scaler, data parallelism) sees only those parameters.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_fused::nf4::Nf4Weight;
use candle_fused::RngKey;
use candle_peft::format::{self, lora_a_name, lora_b_name, saved_name};
use candle_peft::{Adapter, Inject, Injected, LinearLayer, Lora, LoraConfig, LoraInjector};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::load::finite;
use crate::model::{
    Builder, Ctx, Kernels, Layout, LinearAdapter, Model, ModelConfig, Params, Quant, WeightMap,
};
use crate::Result as ModelResult;
use crate::{Error, Result};

pub(crate) mod base;
mod layers;
mod quant;

pub use base::{check_adapter_base, BaseIdentity, RecordedBase, BASE_METADATA_KEY};
pub use layers::Nf4Layers;
pub(crate) use quant::quantize_streamed;
pub use quant::{
    check_quantization_config, dequantized_base, nf4_on_load, read_bnb_4bit, Nf4Settings,
    QuantizedBase, OUTPUT_HEAD,
};

/// A LoRA adapter running one linear layer of the model, with its dropout site.
#[derive(Debug)]
struct LoraLayer {
    lora: Lora,
    site: u64,
}

impl LoraLayer {
    /// The dropout key of a forward over `x` in `ctx`: keyed by the global row, like the
    /// model's dropout ([`Kernels::dropout`]); none outside training.
    fn key(&self, x: &Tensor, ctx: &Ctx) -> candle_core::Result<Option<RngKey>> {
        Ok(match ctx.train {
            true => {
                let row_len = x.elem_count() / x.dim(0)?.max(1);
                Some(RngKey::new(ctx.seed, self.site).with_offset((ctx.row * row_len) as u64))
            }
            false => None,
        })
    }
}

impl LinearAdapter for LoraLayer {
    fn forward(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        ctx: &Ctx,
    ) -> candle_core::Result<Tensor> {
        let key = self.key(x, ctx)?;
        match ctx.kernels {
            Kernels::Fused => self.lora.forward(x, w, b, key),
            Kernels::Reference => self.lora.forward_composite(x, w, b, key),
        }
    }

    fn forward_nf4(
        &self,
        x: &Tensor,
        w: &Nf4Weight,
        b: Option<&Tensor>,
        compute: DType,
        ctx: &Ctx,
    ) -> candle_core::Result<Tensor> {
        let key = self.key(x, ctx)?;
        let composite = matches!(ctx.kernels, Kernels::Reference);
        if compute == x.dtype() {
            return self.lora.forward_nf4(x, w, b, key, composite);
        }
        // PEFT over bitsandbytes' `Linear4bit` with another compute dtype: the 4-bit product
        // in `compute` (input and bias cast to it, the output back), the adapter in `x`'s.
        let xc = x.to_dtype(compute)?;
        let base = match composite {
            false => candle_fused::qlora::nf4_linear(&xc, w, b)?,
            true => ctx.kernels.linear(&xc, &w.dequantize(compute)?.t()?, b)?,
        };
        let u = match key.filter(|_| self.lora.dropout() > 0.0) {
            Some(k) => candle_fused::dropout::dropout(x, self.lora.dropout(), k)?,
            None => x.clone(),
        };
        let dtype = x.dtype();
        let h = u.broadcast_matmul(&self.lora.a().to_dtype(dtype)?.t()?)?;
        let delta = h.broadcast_matmul(&self.lora.b().to_dtype(dtype)?.t()?)?;
        base.to_dtype(dtype)? + delta.affine(self.lora.scale(), 0.0)?
    }

    fn params(&self) -> Vec<Tensor> {
        vec![self.lora.a().clone(), self.lora.b().clone()]
    }

    fn map(&self, f: WeightMap) -> candle_core::Result<Arc<dyn LinearAdapter>> {
        let lora = self.lora.map(f).map_err(candle_core::Error::wrap)?;
        Ok(Arc::new(LoraLayer {
            lora,
            site: self.site,
        }))
    }
}

/// The dropout site of the adapter at `path`: a hash of the path, with the top bit set so it
/// never meets the model's own sites (small integers).
fn site_of(path: &str) -> u64 {
    let mut h = candle_data::hash::Hasher64::new();
    h.update(path.as_bytes());
    h.finish() | (1 << 63)
}

/// How a run trains its model.
#[derive(Clone, Debug)]
pub enum Tuning {
    /// Every weight (the optimiser holds them all).
    Full,
    /// LoRA adapters over a frozen base.
    Lora {
        /// The adapters' config.
        config: Box<LoraConfig>,
        /// The base they adapt.
        base: BaseIdentity,
        /// The frozen originals of the modules to save, restored with the adapters off.
        saved: SavedModules,
    },
}

/// The modules a LoRA run saves (trains in full), each parameter's trainable copy with the
/// frozen original it was copied from, as PEFT's `ModulesToSaveWrapper` keeps both: the
/// original computes when the adapters are off ([`Tuning::without_adapters`]).
#[derive(Clone, Debug, Default)]
pub struct SavedModules(Vec<(Tensor, Tensor)>);

impl Tuning {
    /// The base model's identity, for a LoRA run.
    pub fn base(&self) -> Option<&BaseIdentity> {
        match self {
            Tuning::Full => None,
            Tuning::Lora { base, .. } => Some(base),
        }
    }

    /// LoRA over the frozen weights `params` of the model `config` (the base `base`, cast to
    /// `base_dtype`): the adapted model, its trainable parameters (adapters from `from`, or
    /// PEFT's initialisation drawn with `seed`; see [`adapt`]) and the tuning that records
    /// them, its config as PEFT records it for this model (`fan_in_fan_out` for GPT-2).
    pub fn lora(
        config: &dyn ModelConfig,
        params: &Params,
        lora: &LoraConfig,
        from: Option<&Adapter>,
        base: BaseIdentity,
        base_dtype: DType,
        seed: u64,
    ) -> Result<(Box<dyn Model>, Params, Tuning)> {
        Self::lora_over(config, params, lora, from, base, base_dtype, None, seed)
    }

    /// [`Tuning::lora`] with the base's linear layers held in 4 bits as `quant` holds them
    /// (QLoRA: a saved 4-bit model's, or quantized on load), when given; `params` holds the
    /// other tensors.
    #[allow(clippy::too_many_arguments)]
    pub fn lora_over(
        config: &dyn ModelConfig,
        params: &Params,
        lora: &LoraConfig,
        from: Option<&Adapter>,
        base: BaseIdentity,
        base_dtype: DType,
        quant: Option<&Nf4Layers>,
        seed: u64,
    ) -> Result<(Box<dyn Model>, Params, Tuning)> {
        let layers = quant.map(|q| move |p: &str, i: usize, o: usize| q.quant(p, i, o));
        let compute = quant.and_then(|q| q.compute_dtype);
        let quant = layers.as_ref().map(|q| (q as Quant<'_>, compute));
        let (model, injected, saved) = inject(config, params, quant, lora, from, base_dtype, seed)?;
        let tuning = Tuning::Lora {
            config: Box::new(injected.config),
            base,
            saved,
        };
        Ok((model, Params::from_vars(injected.trainable), tuning))
    }

    /// `model` (built by this tuning) as its base computes it, run under
    /// [`Ctx::without_adapters`]: each module to save back to its frozen original (PEFT's
    /// `disable_adapter`, which restores them too); the LoRA layers are off by the context.
    /// For full fine-tuning, `model` itself. Cheap (the tensors are shared), so that an
    /// evaluation or a reference model can take it at every step.
    ///
    /// ```no_run
    /// # fn f(t: &candle_models::lora::Tuning, m: &dyn candle_models::model::Model, idx: &candle_core::Tensor) -> candle_models::Result<()> {
    /// use candle_models::model::Ctx;
    /// let base_logits = t.without_adapters(m)?.forward(idx, &Ctx::eval().without_adapters())?;
    /// # Ok(()) }
    /// ```
    pub fn without_adapters(&self, model: &dyn Model) -> Result<Box<dyn Model>> {
        let swap: std::collections::HashMap<_, Tensor> = match self {
            Tuning::Full => Default::default(),
            Tuning::Lora { saved, .. } => {
                saved.0.iter().map(|(c, o)| (c.id(), o.clone())).collect()
            }
        };
        Ok(model.map(&|t: &Tensor| Ok(swap.get(&t.id()).unwrap_or(t).clone()))?)
    }

    /// The base as a run's `trainer_state.json` records it, for a LoRA run.
    pub fn recorded_base(&self) -> Option<RecordedBase> {
        self.base().cloned().map(RecordedBase::Semantic)
    }

    /// How the trainable parameters `params` split for the FLOP count: `(adapter elements,
    /// the others)` for a LoRA run (the others being the modules to save), `None` when every
    /// weight trains.
    pub fn trainable_split(&self, params: &Params) -> Option<(usize, usize)> {
        match self {
            Tuning::Full => None,
            Tuning::Lora { .. } => {
                let adapters: usize = params
                    .iter()
                    .filter(|(n, _)| n.ends_with(".lora_A.weight") || n.ends_with(".lora_B.weight"))
                    .map(|(_, v)| v.elem_count())
                    .sum();
                Some((adapters, params.num_elements() - adapters))
            }
        }
    }
}

fn peft_err(e: candle_peft::PeftError) -> Error {
    Error::Config(e.to_string())
}

/// Reads the PEFT adapter in `dir` onto `device`: the one way adapters enter the trainer.
///
/// Its tensors are checked as weights are ([`finite::check_tensors`]: floating point, every
/// value finite), naming `adapter_model.safetensors` and the tensor; [`Adapter::load`] has
/// checked the names and the rank `r`; [`adapt`] checks the rest against the model.
pub fn read_adapter(dir: &Path, device: &Device) -> Result<Adapter> {
    let adapter = Adapter::load(dir, device).map_err(peft_err)?;
    let named: Vec<(String, &Tensor)> = adapter
        .loras
        .iter()
        .flat_map(|(p, (a, b))| [(lora_a_name(p), a), (lora_b_name(p), b)])
        .chain(adapter.saved.iter().map(|(n, t)| (saved_name(n), t)))
        .collect();
    finite::check_tensors(
        &dir.join(format::ADAPTER_WEIGHTS_FILE),
        "adapter",
        named.iter().map(|(n, t)| (n.as_str(), *t)),
    )?;
    Ok(adapter)
}

/// How many times the largest magnitude of the weight it adapts an adapter's update may reach.
/// Fine-tuning moves weights by a fraction of their scale; an update ten thousand times
/// larger is a corrupt value (a flipped exponent bit: `1e38` in `lora_A`) or a diverged run,
/// and the model it makes computes garbage without overflowing (the next RMSNorm rescales it).
pub(crate) const MAX_UPDATE_RATIO: f64 = 1e4;

/// Errors, naming the adapter's file and the module, unless `s · B A` of `lora` is finite in
/// f32 (the dtype merging and the trainer compute it in) and at most [`MAX_UPDATE_RATIO`]
/// times the largest magnitude of the weight `w` it adds to (at least 1e-3: a zero weight).
///
/// Finite `A` and `B` are not enough: `1e38` is a finite f32, and `B A` of two such matrices
/// overflows. A bound on each value alone would be arbitrary (small `A` times large `B` is
/// fine), so the rules are on what enters the model, the product, against what it changes.
fn check_delta(dir: &Path, path: &str, lora: &Lora, w: Option<&Tensor>) -> Result<()> {
    let delta = lora.delta_weight().map_err(peft_err)?;
    let file = dir.join(format::ADAPTER_WEIGHTS_FILE);
    let (a, b) = (lora_a_name(path), lora_b_name(path));
    if let Some((i, v)) = finite::first_non_finite(&delta)? {
        return Err(Error::checkpoint(
            file,
            format!(
                "module `{path}`: the adapter's weight update s · lora_B · lora_A overflows \
                 f32 ({v} at flat index {i} of {:?}): `{a}` and `{b}` hold values too large",
                delta.dims(),
            ),
        ));
    }
    let Some(w) = w else { return Ok(()) };
    let largest = |t: &Tensor| -> Result<f64> {
        Ok(t.abs()?
            .max_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?)
    };
    let (update, weight) = (largest(&delta)?, largest(w)?);
    if update > MAX_UPDATE_RATIO * weight.max(1e-3) {
        return Err(Error::checkpoint(
            file,
            format!(
                "module `{path}`: the adapter's weight update s · lora_B · lora_A reaches \
                 {update:.3e}, {:.1e} times the largest magnitude of the weight it adapts \
                 ({weight:.3e}; at most {MAX_UPDATE_RATIO:e} times): `{a}` or `{b}` holds \
                 corrupt or diverged values",
                update / weight.max(1e-3)
            ),
        ));
    }
    Ok(())
}

/// Builds `config`'s model over the frozen `base` weights (cast to `base_dtype`, detached:
/// they get no gradient) with LoRA adapters where `lora` targets, and returns it with its
/// trainable parameters (by PEFT's on-disk names).
///
/// The adapters start from `from` (an adapter read from a PEFT directory or a checkpoint,
/// whose every tensor must be used, with the shapes the model needs) or, without one, from
/// PEFT's initialisation drawn from a generator seeded with `seed`. Errors: a target that
/// matches no linear layer (listing some that exist), a module to save that has no
/// parameter, an adapter that does not fit.
pub fn adapt(
    config: &dyn ModelConfig,
    base: &Params,
    lora: &LoraConfig,
    from: Option<&Adapter>,
    base_dtype: DType,
    seed: u64,
) -> Result<(Box<dyn Model>, Params)> {
    adapt_recorded(config, base, lora, from, base_dtype, seed).map(|(m, p, _)| (m, p))
}

/// [`adapt`], also returning the LoRA config as it is recorded for this model (PEFT's
/// `fan_in_fan_out` set for GPT-2's `[in, out]` layers).
pub fn adapt_recorded(
    config: &dyn ModelConfig,
    base: &Params,
    lora: &LoraConfig,
    from: Option<&Adapter>,
    base_dtype: DType,
    seed: u64,
) -> Result<(Box<dyn Model>, Params, LoraConfig)> {
    let (model, injected, _) = inject(config, base, None, lora, from, base_dtype, seed)?;
    Ok((
        model,
        Params::from_vars(injected.trainable),
        injected.config,
    ))
}

/// [`adapt`] over a base whose linear layers `quant` holds in 4 bits (QLoRA: by module path,
/// e.g. [`QuantizedBase::quant`] or [`nf4_on_load`]); `base` holds the other tensors (and
/// may hold the quantized layers' weights too, which are then not read).
pub fn adapt_quantized(
    config: &dyn ModelConfig,
    base: &Params,
    quant: Quant<'_>,
    lora: &LoraConfig,
    from: Option<&Adapter>,
    base_dtype: DType,
    seed: u64,
) -> Result<(Box<dyn Model>, Params)> {
    let quant = Some((quant, None));
    let (model, injected, _) = inject(config, base, quant, lora, from, base_dtype, seed)?;
    Ok((model, Params::from_vars(injected.trainable)))
}

/// The injection behind [`adapt`]: the model built through a [`LoraInjector`] (which decides
/// and creates the adapters), each adapter loaded from `from` checked against the weight it
/// adapts ([`check_delta`]), and the frozen originals of the modules to save. `quant`: the
/// 4-bit layers, and the dtype they compute in if not the context's.
fn inject(
    config: &dyn ModelConfig,
    base: &Params,
    quant: Option<(Quant<'_>, Option<DType>)>,
    lora: &LoraConfig,
    from: Option<&Adapter>,
    base_dtype: DType,
    seed: u64,
) -> Result<(Box<dyn Model>, Injected, SavedModules)> {
    let device = base
        .iter()
        .next()
        .map(|(_, v)| v.device().clone())
        .unwrap_or(Device::Cpu);
    let rng = ChaCha8Rng::seed_from_u64(seed ^ 0x104A_0000);
    let injector = LoraInjector::new(lora, from, rng, &device).map_err(peft_err)?;
    let what = match from {
        Some(a) => a.dir.display().to_string(),
        None => "the LoRA config".to_string(),
    };
    let saved = std::cell::RefCell::new(Vec::new());
    let source = |name: &str, shape: &[usize]| -> ModelResult<Tensor> {
        let t = base.tensor(name)?;
        if t.dims() != shape {
            return Err(Error::Config(format!(
                "{what}: base weight `{name}` is {:?}, the model needs {shape:?}",
                t.dims()
            )));
        }
        let frozen = t.detach().to_dtype(base_dtype)?;
        match injector.parameter(name, &t).map_err(peft_err)? {
            Some(trainable) => {
                saved.borrow_mut().push((trainable.clone(), frozen));
                Ok(trainable)
            }
            None => Ok(frozen),
        }
    };
    let wrap = |path: &str,
                fan_in: usize,
                fan_out: usize,
                layout: Layout|
     -> ModelResult<Option<Arc<dyn LinearAdapter>>> {
        let layer = LinearLayer {
            path,
            fan_in,
            fan_out,
            fan_in_fan_out: layout == Layout::InOut,
            is_output_head: path == OUTPUT_HEAD,
        };
        let Some(lora) = injector.linear(&layer).map_err(peft_err)? else {
            return Ok(None);
        };
        if let Some(adapter) = from {
            let w = base.get(&format!("{path}.weight")).map(|v| v.as_tensor());
            check_delta(&adapter.dir, path, &lora, w)?;
        }
        Ok(Some(Arc::new(LoraLayer {
            lora,
            site: site_of(path),
        })))
    };
    let builder = Builder::root(&source).with_wrap(&wrap);
    let builder = match quant {
        Some((q, compute)) => builder.with_quant(q).with_quant_compute(compute),
        None => builder,
    };
    let model = config.build(&builder)?;
    let injected = injector.finish(&config.describe()).map_err(peft_err)?;
    Ok((model, injected, SavedModules(saved.into_inner())))
}

/// Checks that `adapter` fits the model `config` over `base` as [`adapt`] does (every tensor
/// used by a module its `target_modules` select, every selected module adapted, the model's
/// shapes, a finite update), without keeping the adapted model.
pub fn fit(config: &dyn ModelConfig, base: &Params, adapter: &Adapter) -> Result<()> {
    fit_over(config, base, None, adapter)
}

/// [`fit`] over a base whose linear layers `quant` holds in 4 bits, when given.
pub(crate) fn fit_over(
    config: &dyn ModelConfig,
    base: &Params,
    quant: Option<&Nf4Layers>,
    adapter: &Adapter,
) -> Result<()> {
    let layers = quant.map(|q| move |p: &str, i: usize, o: usize| q.quant(p, i, o));
    let quant = layers.as_ref().map(|q| (q as Quant<'_>, None));
    let lora = &adapter.config;
    inject(config, base, quant, lora, Some(adapter), DType::F32, 0).map(drop)
}

/// The base parameters of the model `config` with `adapter` merged in (`W + s B A` for every
/// adapted module, the saved modules' parameters replaced), in f32: a model for inference or
/// export.
///
/// The adapter is first fitted to the model by [`adapt`], as for training, so that merging
/// refuses what training refuses: tensors for modules its `target_modules` do not select, a
/// selected module without tensors, shapes the model does not have, an update that overflows.
/// A merged weight must be finite too.
pub fn merge(config: &dyn ModelConfig, base: &Params, adapter: &Adapter) -> Result<Params> {
    let (_, injected, _) = inject(
        config,
        base,
        None,
        &adapter.config,
        Some(adapter),
        DType::F32,
        0,
    )?;
    let file = adapter.dir.join(format::ADAPTER_WEIGHTS_FILE);
    let what = adapter.dir.display().to_string();
    let mut tensors: BTreeMap<String, Tensor> = base
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    for (path, (a, b)) in &adapter.loras {
        let name = format!("{path}.weight");
        let w = tensors.get(&name).ok_or_else(|| {
            Error::Config(format!(
                "{what}: has an adapter for `{path}`, which is not a layer of the base model"
            ))
        })?;
        let lora = Lora::new(a.clone(), b.clone(), &adapter.config)
            .map_err(peft_err)?
            .with_fan_in_fan_out(injected.transposed.contains(path));
        let merged = lora
            .merge(w)
            .map_err(|e| Error::Config(format!("{what}: `{path}`: {e}")))?;
        finite::check_tensors(&file, "merged", [(name.as_str(), &merged)])?;
        tensors.insert(name, merged);
    }
    for (name, t) in &adapter.saved {
        let old = tensors.get(name).ok_or_else(|| {
            Error::Config(format!(
                "{what}: saves `{name}`, which is not a parameter of the base model"
            ))
        })?;
        if old.dims() != t.dims() {
            return Err(Error::Config(format!(
                "{what}: `{}` is {:?}, the base model's `{name}` is {:?}",
                saved_name(name),
                t.dims(),
                old.dims()
            )));
        }
        tensors.insert(name.clone(), t.to_dtype(old.dtype())?);
    }
    Params::from_tensors(tensors)
}
