//! [`ScaledUpdate`]: the optimiser update [`Amp::step`](crate::Amp::step) drives.

use candle_core::backprop::GradStore;
use candle_core::Var;
use candle_nn::Optimizer;

use crate::check;

/// An optimiser update that applies `coef * grad`, where `coef` folds unscaling and clipping
/// into one coefficient, so that [`Amp::step`](crate::Amp::step) never copies the gradients
/// for an update that can multiply them as it reads them (a fused AdamW).
///
/// Any `candle_nn::Optimizer` gets one through [`Plain`]. A fused optimiser implements it
/// itself: [`apply`](Self::apply) with its own kernel, and [`grad_norm`](Self::grad_norm) with
/// its own reduction if it has a faster one.
///
/// ```
/// use candle_amp::ScaledUpdate;
/// use candle_core::{backprop::GradStore, Var};
///
/// /// SGD that multiplies each gradient by `coef` as it reads it (no scaled copy).
/// struct FusedSgd(f64);
///
/// impl ScaledUpdate for FusedSgd {
///     type Error = candle_core::Error;
///     fn apply(&mut self, grads: &GradStore, vars: &[Var], coef: f64) -> candle_core::Result<()> {
///         for v in vars {
///             if let Some(g) = grads.get(v) {
///                 v.set(&(v.as_tensor() - g.affine(self.0 * coef, 0.0)?)?)?;
///             }
///         }
///         Ok(())
///     }
/// }
/// ```
pub trait ScaledUpdate {
    /// The update's error; [`Amp::step`](crate::Amp::step) returns it as
    /// [`AmpError::Update`](crate::AmpError::Update), with it as the cause.
    type Error: std::error::Error + Send + Sync + 'static + From<candle_core::Error>;

    /// The global L2 norm of the gradients of `vars` in `grads`, as they are (at the loss
    /// scale; missing gradients count as zero). Any non-finite value (inf, NaN, or a sum of
    /// squares past the f32 range) is fine: [`Amp::step`](crate::Amp::step) then scans the
    /// gradients itself.
    ///
    /// The default upcasts each gradient to f32 and sums the squares in one reduction with
    /// one host sync.
    fn grad_norm(&mut self, grads: &GradStore, vars: &[Var]) -> Result<f64, Self::Error> {
        let sq = check::sum_of_squares(vars.iter().filter_map(|v| grads.get(v)))?;
        Ok(f64::from(sq).sqrt())
    }

    /// Updates `vars` with `coef * grad` for every variable that has a gradient in `grads`
    /// (leaving the others alone). `grads` holds f32 gradients keyed by `vars`.
    fn apply(&mut self, grads: &GradStore, vars: &[Var], coef: f64) -> Result<(), Self::Error>;
}

/// [`ScaledUpdate`] for any `candle_nn::Optimizer` built over the master variables: it steps
/// the optimiser with the gradients themselves when `coef` is 1 (f32 without clipping: no
/// copy), and with a scaled copy otherwise.
///
/// ```
/// use candle_amp::{Amp, MasterWeights, Plain, ScalerConfig, WeightMode};
/// use candle_core::{DType, Device, Tensor, Var};
/// use candle_nn::Optimizer as _;
/// let w = Var::from_tensor(&Tensor::new(&[3f32, 4.0], &Device::Cpu)?)?;
/// let weights = MasterWeights::new([("w".into(), w.clone())], DType::F32, WeightMode::Cast)?;
/// let mut amp = Amp::new(weights, ScalerConfig::none())?.with_clip_norm(Some(1.0))?;
/// let mut sgd = candle_nn::SGD::new(amp.weights().master_vars(), 1.0)?;
/// let grads = amp.backward(&(w.as_tensor().sqr()?.sum_all()? * 0.5)?)?; // grad = w
/// let outcome = amp.step(&grads, &mut Plain(&mut sgd))?;
/// assert!((outcome.grad_norm().unwrap() - 5.0).abs() < 1e-6);
/// let w1 = w.as_tensor().to_vec1::<f32>()?; // w - w / |w|: clipped to norm 1
/// assert!((w1[0] - 2.4).abs() < 1e-6 && (w1[1] - 3.2).abs() < 1e-6);
/// # Ok::<(), candle_amp::AmpError>(())
/// ```
#[derive(Debug)]
pub struct Plain<'a, O>(pub &'a mut O);

impl<O: Optimizer> ScaledUpdate for Plain<'_, O> {
    type Error = candle_core::Error;

    fn apply(&mut self, grads: &GradStore, vars: &[Var], coef: f64) -> candle_core::Result<()> {
        if coef == 1.0 {
            return self.0.step(grads);
        }
        let mut scaled = GradStore::default();
        for v in vars {
            if let Some(g) = grads.get(v) {
                scaled.insert(v, g.affine(coef, 0.0)?);
            }
        }
        self.0.step(&scaled)
    }
}
