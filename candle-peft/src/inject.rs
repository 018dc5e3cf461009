//! Putting LoRA adapters into a model while it is built: the model offers each of its linear
//! layers ([`LinearLayer`]) and each of its parameters to an [`Inject`], which answers with the
//! adapter that runs the layer (or none) and the tensor the parameter is (the frozen base
//! tensor, or a trainable copy for a module to save). [`LoraInjector`] is PEFT's
//! `get_peft_model` / `PeftModel.from_pretrained` behind that trait: it decides by
//! [`LoraConfig`] which layers are adapted, initialises `A` and `B` or takes them from an
//! [`Adapter`], and keeps the trainable tensors by PEFT's on-disk names.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use candle_core::{DType, Device, Tensor, Var};
use rand::Rng;

use crate::error::{PeftError, Result};
use crate::format::{lora_a_name, lora_b_name, module_of, saved_name, PREFIX};
use crate::{Adapter, Lora, LoraConfig, TargetModules};

/// A linear layer a model offers for adaptation.
#[derive(Clone, Copy, Debug)]
pub struct LinearLayer<'a> {
    /// Its module path (`model.layers.0.self_attn.q_proj`, `transformer.h.0.attn.c_attn`).
    pub path: &'a str,
    /// Input features.
    pub fan_in: usize,
    /// Output features.
    pub fan_out: usize,
    /// Whether its weight is stored `[in, out]` (GPT-2's `Conv1D`; PEFT's `fan_in_fan_out`)
    /// rather than `[out, in]` (`torch.nn.Linear`). The adapter's tensors are the same either
    /// way (`A [r, in]`, `B [out, r]`); merging transposes its update.
    pub fan_in_fan_out: bool,
    /// Whether it is the model's output head (left out by `all-linear`).
    pub is_output_head: bool,
}

/// What a model offers its linear layers and parameters to while it is built.
pub trait Inject {
    /// The adapter that runs `layer` (`y = base(x) + s B A x`), or `None` to leave it plain.
    fn linear(&self, layer: &LinearLayer) -> Result<Option<Lora>>;

    /// The tensor the model uses for its parameter `name` (`lm_head.weight`), given the base
    /// tensor: `None` for the base tensor itself (frozen), or a trainable copy.
    fn parameter(&self, name: &str, base: &Tensor) -> Result<Option<Tensor>>;
}

/// What a [`LoraInjector`] put into a model.
#[derive(Debug)]
pub struct Injected {
    /// The trainable tensors (adapters, modules to save) by PEFT's on-disk names.
    pub trainable: BTreeMap<String, Var>,
    /// The config as PEFT records it for this model: `fan_in_fan_out` set when the adapted
    /// layers store their weight `[in, out]` (PEFT sets it so for `Conv1D` layers).
    pub config: LoraConfig,
    /// The module paths of the adapted layers stored `[in, out]`.
    pub transposed: BTreeSet<String>,
}

/// PEFT's LoRA injection: adapters on the linear layers `config` targets, trainable copies of
/// the modules it saves, fresh (PEFT's initialisation) or from an [`Adapter`].
///
/// After the model is built, [`LoraInjector::finish`] checks what was offered against the
/// config and the adapter and returns what was injected ([`Injected`]).
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_peft::inject::{Inject, LinearLayer, LoraInjector};
/// use candle_peft::LoraConfig;
/// let cfg = LoraConfig::new(2, 4.0).with_targets("q_proj".parse()?);
/// let inj = LoraInjector::new(&cfg, None, rand::rng(), &Device::Cpu)?;
/// // A tiny model offers its two linear layers as it builds them.
/// let layer = |path| LinearLayer { path, fan_in: 4, fan_out: 3, fan_in_fan_out: false, is_output_head: false };
/// let q = inj.linear(&layer("layers.0.q_proj"))?.expect("targeted");
/// assert!(inj.linear(&layer("layers.0.k_proj"))?.is_none());
/// let w = Tensor::zeros((3, 4), DType::F32, &Device::Cpu)?;
/// let x = Tensor::ones((1, 4), DType::F32, &Device::Cpu)?;
/// assert_eq!(q.forward(&x, &w.t()?, None, None)?.to_vec2::<f32>()?, [[0.0; 3]]); // B = 0
/// let done = inj.finish("a tiny model")?;
/// assert_eq!(done.trainable.len(), 2); // lora_A and lora_B of q_proj
/// assert!(done.trainable.contains_key("base_model.model.layers.0.q_proj.lora_A.weight"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct LoraInjector<'a, R: Rng> {
    config: LoraConfig,
    from: Option<&'a Adapter>,
    rng: RefCell<R>,
    device: Device,
    /// What errors name: the adapter's directory, or "the LoRA config".
    what: String,
    trainable: RefCell<BTreeMap<String, Var>>,
    /// Paths of every linear layer offered.
    offered: RefCell<Vec<String>>,
    /// Paths of the adapted layers whose weight is `[in, out]`.
    transposed: RefCell<BTreeSet<String>>,
    /// Modules the targets select that the adapter has no tensors for.
    missing: RefCell<Vec<String>>,
}

impl<'a, R: Rng> LoraInjector<'a, R> {
    /// An injector for `config`, taking `A` and `B` from `from` when given (every one of its
    /// tensors must then be used) or drawing PEFT's initialisation from `rng`, on `device`.
    pub fn new(
        config: &LoraConfig,
        from: Option<&'a Adapter>,
        rng: R,
        device: &Device,
    ) -> Result<Self> {
        config.validate()?;
        let what = match from {
            Some(a) => a.dir.display().to_string(),
            None => "the LoRA config".to_string(),
        };
        Ok(LoraInjector {
            config: config.clone(),
            from,
            rng: RefCell::new(rng),
            device: device.clone(),
            what,
            trainable: RefCell::new(BTreeMap::new()),
            offered: RefCell::new(Vec::new()),
            transposed: RefCell::new(BTreeSet::new()),
            missing: RefCell::new(Vec::new()),
        })
    }

    fn mismatch(&self, message: String) -> PeftError {
        PeftError::Mismatch {
            what: self.what.clone(),
            message,
        }
    }

    /// Checks what the model offered against the config and the adapter, and returns what
    /// was injected: the trainable tensors by PEFT's on-disk names, the config as PEFT records
    /// it for this model. `model` names the model in errors.
    ///
    /// Errors: a selected module the adapter has no tensors for, targets that matched no
    /// linear layer (naming those that exist), a module to save with no parameter, adapter
    /// tensors the model did not use.
    pub fn finish(self, model: &str) -> Result<Injected> {
        let describe = model;
        let config = &self.config;
        let missing = self.missing.take();
        if !missing.is_empty() {
            let names: Vec<&str> = missing.iter().map(String::as_str).collect();
            return Err(self.mismatch(format!(
                "its target_modules `{}` select {} module(s) it has no lora_A/lora_B for: {}",
                config.target_modules,
                names.len(),
                name_some(&names)
            )));
        }
        let trainable = self.trainable.take();
        let offered = self.offered.take();
        let adapted: Vec<&str> = trainable
            .keys()
            .filter_map(|n| n.strip_suffix(".lora_A.weight"))
            .filter_map(|n| n.strip_prefix(PREFIX))
            .collect();
        if adapted.is_empty() {
            let mut some: Vec<&str> = offered
                .iter()
                .map(|p| p.rsplit('.').next().unwrap_or(p))
                .collect();
            some.sort();
            some.dedup();
            return Err(PeftError::Mismatch {
                what: self.what.clone(),
                message: format!(
                    "target_modules `{}` match no linear layer of the model ({describe}); its \
                     linear layers are named {}",
                    config.target_modules,
                    some.join(", ")
                ),
            });
        }
        for m in &config.modules_to_save {
            let one = TargetModules::Names(vec![m.clone()]);
            let found = trainable
                .keys()
                .filter_map(|n| n.strip_prefix(PREFIX))
                .any(|n| {
                    !n.ends_with(".lora_A.weight")
                        && !n.ends_with(".lora_B.weight")
                        && one.matches(module_of(n), false)
                });
            if !found {
                return Err(PeftError::Mismatch {
                    what: self.what.clone(),
                    message: format!(
                        "modules_to_save `{m}` matches no module with parameters in the model \
                         ({describe}); a head tied to the embedding has none of its own"
                    ),
                });
            }
        }
        if let Some(a) = self.from {
            let stray: Vec<&str> = a
                .loras
                .keys()
                .map(String::as_str)
                .filter(|p| !adapted.contains(p))
                .collect();
            if !stray.is_empty() {
                return Err(self.mismatch(format!(
                    "has lora_A/lora_B for {} module(s) that are not linear layers of the model \
                     selected by its target_modules `{}`: {}",
                    stray.len(),
                    config.target_modules,
                    name_some(&stray)
                )));
            }
            if let Some(n) = a
                .saved
                .keys()
                .find(|n| !trainable.contains_key(&saved_name(n)))
            {
                return Err(self.mismatch(format!(
                    "has `{}`, which the model has no parameter for",
                    saved_name(n)
                )));
            }
        }
        let mut config = self.config.clone();
        let transposed = self.transposed.take();
        config.fan_in_fan_out = !transposed.is_empty();
        Ok(Injected {
            trainable,
            config,
            transposed,
        })
    }
}

impl<R: Rng> Inject for LoraInjector<'_, R> {
    fn linear(&self, layer: &LinearLayer) -> Result<Option<Lora>> {
        let (path, fan_in, fan_out) = (layer.path, layer.fan_in, layer.fan_out);
        self.offered.borrow_mut().push(path.to_string());
        let lora = &self.config;
        if !lora.target_modules.matches(path, layer.is_output_head) || lora.saves(path) {
            return Ok(None);
        }
        let (a, b) = match self.from {
            Some(adapter) => match adapter.loras.get(path) {
                Some((a, b)) => {
                    let want = ([lora.r, fan_in], [fan_out, lora.r]);
                    if a.dims() != want.0 || b.dims() != want.1 {
                        return Err(self.mismatch(format!(
                            "module `{path}`: lora_A {:?} / lora_B {:?}, the model's \
                             {fan_in} -> {fan_out} layer needs {:?} / {:?}",
                            a.dims(),
                            b.dims(),
                            want.0,
                            want.1
                        )));
                    }
                    (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?)
                }
                None => {
                    self.missing.borrow_mut().push(path.to_string());
                    return Ok(None);
                }
            },
            None => Lora::init(
                fan_in,
                fan_out,
                lora,
                &mut *self.rng.borrow_mut(),
                DType::F32,
                &self.device,
            )?,
        };
        let (a, b) = (Var::from_tensor(&a)?, Var::from_tensor(&b)?);
        let mut t = self.trainable.borrow_mut();
        t.insert(lora_a_name(path), a.clone());
        t.insert(lora_b_name(path), b.clone());
        if layer.fan_in_fan_out {
            self.transposed.borrow_mut().insert(path.to_string());
        }
        let l = Lora::new(a.as_tensor().clone(), b.as_tensor().clone(), lora)?;
        Ok(Some(l.with_fan_in_fan_out(layer.fan_in_fan_out)))
    }

    fn parameter(&self, name: &str, base: &Tensor) -> Result<Option<Tensor>> {
        if !self.config.saves(module_of(name)) {
            return Ok(None);
        }
        let value = match self.from.and_then(|a| a.saved.get(name)) {
            Some(s) if s.dims() != base.dims() => {
                return Err(self.mismatch(format!(
                    "`{}` is {:?}, the model needs {:?}",
                    saved_name(name),
                    s.dims(),
                    base.dims()
                )))
            }
            Some(s) => s.to_dtype(DType::F32)?,
            None => base.detach().to_dtype(DType::F32)?,
        };
        let var = Var::from_tensor(&value)?;
        self.trainable
            .borrow_mut()
            .insert(saved_name(name), var.clone());
        Ok(Some(var.as_tensor().clone()))
    }
}

/// Up to eight of `names`, then how many more.
fn name_some(names: &[&str]) -> String {
    let shown: Vec<String> = names.iter().take(8).map(|n| format!("`{n}`")).collect();
    match names.len() > 8 {
        true => format!("{} and {} more", shown.join(", "), names.len() - 8),
        false => shown.join(", "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(path: &str, fan_in_fan_out: bool) -> LinearLayer<'_> {
        LinearLayer {
            path,
            fan_in: 6,
            fan_out: 4,
            fan_in_fan_out,
            is_output_head: false,
        }
    }

    /// A `Conv1D` layer (`[in, out]`) gets the same A and B as a `Linear`; the config records
    /// `fan_in_fan_out`, and the adapter merges its update transposed into the `[in, out]`
    /// weight: the transpose of the `Linear` merge of the transposed weight.
    #[test]
    fn conv1d_layers_take_the_same_adapter_merged_transposed() {
        let dev = Device::Cpu;
        let cfg = LoraConfig::new(2, 4.0);
        let inj = LoraInjector::new(&cfg, None, rand::rng(), &dev).unwrap();
        let lora = inj.linear(&layer("h.0.c_attn", true)).unwrap().unwrap();
        assert_eq!(
            (lora.a().dims(), lora.b().dims()),
            (&[2, 6][..], &[4, 2][..])
        );
        let b = Tensor::randn(0f32, 1.0, (4, 2), &dev).unwrap();
        let lora = Lora::new(lora.a().clone(), b, &cfg).unwrap();
        let w_in_out = Tensor::randn(0f32, 1.0, (6, 4), &dev).unwrap();
        let linear = lora.merge(&w_in_out.t().unwrap()).unwrap();
        let conv = lora.with_fan_in_fan_out(true).merge(&w_in_out).unwrap();
        let d = (conv - linear.t().unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(d, 0.0);
        let done = inj.finish("m").unwrap();
        assert!(done.config.fan_in_fan_out);
        assert!(done.transposed.contains("h.0.c_attn"));
    }

    #[test]
    fn targets_that_match_nothing_name_the_layers() {
        let cfg = LoraConfig::new(2, 4.0).with_targets("q_proj".parse().unwrap());
        let inj = LoraInjector::new(&cfg, None, rand::rng(), &Device::Cpu).unwrap();
        assert!(inj.linear(&layer("h.0.c_fc", false)).unwrap().is_none());
        let e = inj.finish("a tiny model").unwrap_err().to_string();
        assert!(
            e.contains("q_proj") && e.contains("c_fc") && e.contains("a tiny model"),
            "{e}"
        );
    }
}
