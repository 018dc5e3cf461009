//! One LoRA adapter on a linear layer: `y = x Wᵀ + b + s · B A dropout(x)`, with PEFT's
//! tensors (`lora_A.weight [r, in]`, `lora_B.weight [out, r]`), initialisation, merge and
//! unmerge.

use candle_core::{DType, Device, Tensor};
use candle_fused::RngKey;
use rand::Rng;

use crate::error::{PeftError, Result};

/// `candle_fused::lora::lora_linear`'s signature (the fused op or its composite).
type LoraOp = fn(
    &Tensor,
    &Tensor,
    Option<&Tensor>,
    &Tensor,
    &Tensor,
    f64,
    Dropout,
) -> candle_core::Result<Tensor>;

/// The dropout on the adapter input the fused ops take: rate and key, `None` for none.
type Dropout = Option<(f32, RngKey)>;
use crate::LoraConfig;

/// A LoRA adapter: `A [r, in]`, `B [out, r]`, the scaling `s` and the dropout on its input.
///
/// The base layer's weight stays frozen and outside the adapter: [`Lora::forward`] takes it
/// as an argument and no gradient reaches it (only `x`, `A` and `B` get one).
///
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
/// use candle_peft::{Lora, LoraConfig};
/// let dev = Device::Cpu;
/// let cfg = LoraConfig::new(2, 4.0);
/// let w = Tensor::randn(0f32, 1.0, (3, 5), &dev)?; // a frozen [out 3, in 5] weight
/// let (a, b) = Lora::init(5, 3, &cfg, &mut rand::rng(), DType::F32, &dev)?;
/// let (a, b) = (Var::from_tensor(&a)?, Var::from_tensor(&b)?);
/// let lora = Lora::new(a.as_tensor().clone(), b.as_tensor().clone(), &cfg)?;
/// let x = Tensor::randn(0f32, 1.0, (4, 5), &dev)?;
/// let y = lora.forward(&x, &w.t()?, None, None)?; // B = 0: the base layer's output
/// let g = y.sqr()?.sum_all()?.backward()?;
/// assert!(g.get(&b).is_some() && g.get(&w).is_none());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct Lora {
    a: Tensor,
    b: Tensor,
    scale: f64,
    dropout: f32,
    fan_in_fan_out: bool,
}

impl Lora {
    /// The adapter with `a [r, in]` and `b [out, r]` under `config`'s scaling and dropout.
    pub fn new(a: Tensor, b: Tensor, config: &LoraConfig) -> Result<Self> {
        let (r, _) = a.dims2()?;
        let (_, rb) = b.dims2()?;
        if r != rb {
            return Err(PeftError::Mismatch {
                what: "LoRA adapter".into(),
                message: format!(
                    "lora_A {:?} and lora_B {:?} do not share a rank",
                    a.dims(),
                    b.dims()
                ),
            });
        }
        Ok(Lora {
            a,
            b,
            scale: config.scaling(),
            dropout: config.lora_dropout,
            fan_in_fan_out: false,
        })
    }

    /// The same adapter on a layer whose weight is stored `[in, out]` (PEFT's
    /// `fan_in_fan_out`, GPT-2's `Conv1D`) or not: `A` and `B` are the same either way, the
    /// update [`Lora::delta_weight`] and the weights [`Lora::merge`] takes are transposed.
    pub fn with_fan_in_fan_out(self, fan_in_fan_out: bool) -> Self {
        Lora {
            fan_in_fan_out,
            ..self
        }
    }

    /// Whether the base weight is stored `[in, out]` (see [`Lora::with_fan_in_fan_out`]).
    pub fn fan_in_fan_out(&self) -> bool {
        self.fan_in_fan_out
    }

    /// PEFT's default initialisation for a layer `in -> out` (`init_lora_weights=True`): `A`
    /// Kaiming-uniform with `a = sqrt(5)` (uniform in `±1/sqrt(in)`, `nn.Linear`'s default),
    /// `B` zeros, so the adapted layer starts as the base layer. Returns `(A, B)`.
    pub fn init(
        fan_in: usize,
        fan_out: usize,
        config: &LoraConfig,
        rng: &mut impl Rng,
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let bound = 1.0 / (fan_in as f64).sqrt();
        let a: Vec<f32> = (0..config.r * fan_in)
            .map(|_| rng.random_range(-bound..bound) as f32)
            .collect();
        let a = Tensor::from_vec(a, (config.r, fan_in), device)?.to_dtype(dtype)?;
        let b = Tensor::zeros((fan_out, config.r), dtype, device)?;
        Ok((a, b))
    }

    /// `lora_A.weight`, `[r, in]`.
    pub fn a(&self) -> &Tensor {
        &self.a
    }

    /// `lora_B.weight`, `[out, r]`.
    pub fn b(&self) -> &Tensor {
        &self.b
    }

    /// The factor `s` of the adapter's output.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// The dropout probability on the adapter's input.
    pub fn dropout(&self) -> f32 {
        self.dropout
    }

    /// The same adapter with `A` and `B` mapped by `f` (cast, moved; differentiably).
    pub fn map(&self, f: impl Fn(&Tensor) -> candle_core::Result<Tensor>) -> Result<Self> {
        Ok(Lora {
            a: f(&self.a)?,
            b: f(&self.b)?,
            ..self.clone()
        })
    }

    /// The adapted layer's output `x w + bias + s · (dropout(x) Aᵀ) Bᵀ` for `x [.., in]`,
    /// the frozen base weight `w` as an `[in, out]` view (`w_out_in.t()`), in `x`'s dtype
    /// (`A` and `B` are cast to it). `key` draws the dropout mask (training); `None` (or
    /// dropout 0) runs without. One fused op ([`candle_fused::lora`]): gradients for `x`,
    /// `A` and `B` only.
    pub fn forward(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        key: Option<RngKey>,
    ) -> candle_core::Result<Tensor> {
        self.run(candle_fused::lora::lora_linear, x, w, bias, key)
    }

    /// The same computation from plain differentiable Candle ops (the reference).
    pub fn forward_composite(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        key: Option<RngKey>,
    ) -> candle_core::Result<Tensor> {
        self.run(candle_fused::lora::lora_linear_composite, x, w, bias, key)
    }

    /// The adapted layer over a frozen 4-bit base weight `w [out, in]` (QLoRA, PEFT's
    /// `Linear4bit`): `x Wᵀ + bias + s · (dropout(x) Aᵀ) Bᵀ` with `W` dequantized a tile at a
    /// time ([`candle_fused::qlora::qlora_linear`]), in `x`'s dtype; gradients for `x`, `A` and
    /// `B` only. `composite`: the whole weight dequantized and
    /// [`forward_composite`](Lora::forward_composite)'s ops (the reference).
    pub fn forward_nf4(
        &self,
        x: &Tensor,
        w: &candle_fused::nf4::Nf4Weight,
        bias: Option<&Tensor>,
        key: Option<RngKey>,
        composite: bool,
    ) -> candle_core::Result<Tensor> {
        let (a, b, dropout) = self.operands(x, key)?;
        let op = match composite {
            true => candle_fused::qlora::qlora_linear_composite,
            false => candle_fused::qlora::qlora_linear,
        };
        op(x, w, bias, &a, &b, self.scale, dropout)
    }

    /// `op` over `x` with `A` and `B` cast to `x`'s dtype, dropout when keyed.
    fn run(
        &self,
        op: LoraOp,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        key: Option<RngKey>,
    ) -> candle_core::Result<Tensor> {
        let (a, b, dropout) = self.operands(x, key)?;
        op(x, w, bias, &a, &b, self.scale, dropout)
    }

    /// `A` and `B` cast to `x`'s dtype, and the dropout (rate and key) when keyed and non-zero.
    fn operands(
        &self,
        x: &Tensor,
        key: Option<RngKey>,
    ) -> candle_core::Result<(Tensor, Tensor, Dropout)> {
        let dtype = x.dtype();
        let (a, b) = (self.a.to_dtype(dtype)?, self.b.to_dtype(dtype)?);
        let dropout = key
            .filter(|_| self.dropout > 0.0)
            .map(|k| (self.dropout, k));
        Ok((a, b, dropout))
    }

    /// `s · B A`, `[out, in]` (`[in, out]` under `fan_in_fan_out`): what merging adds to the
    /// base weight, computed in f32 (f64 for f64 adapters).
    pub fn delta_weight(&self) -> Result<Tensor> {
        let dt = match self.a.dtype() {
            DType::F64 => DType::F64,
            _ => DType::F32,
        };
        let (a, b) = (self.a.detach().to_dtype(dt)?, self.b.detach().to_dtype(dt)?);
        let d = (b.matmul(&a)? * self.scale)?;
        Ok(match self.fan_in_fan_out {
            true => d.t()?.contiguous()?,
            false => d,
        })
    }

    /// The merged weight `W + s B A` of the base weight `w [out, in]` (`[in, out]` under
    /// `fan_in_fan_out`, adding the transposed update), in `w`'s dtype (the
    /// sum computed in f32 and rounded once).
    pub fn merge(&self, w: &Tensor) -> Result<Tensor> {
        self.shift(w, 1.0)
    }

    /// The base weight back from a merged one: `W - s B A` (in `w`'s dtype; exact up to that
    /// dtype's rounding of the merged weight).
    pub fn unmerge(&self, w: &Tensor) -> Result<Tensor> {
        self.shift(w, -1.0)
    }

    fn shift(&self, w: &Tensor, sign: f64) -> Result<Tensor> {
        let d = self.delta_weight()?;
        if w.dims() != d.dims() {
            return Err(PeftError::Mismatch {
                what: "LoRA merge".into(),
                message: format!(
                    "the base weight {:?} is not {} = {:?}",
                    w.dims(),
                    match self.fan_in_fan_out {
                        true => "[in, out]",
                        false => "[out, in]",
                    },
                    d.dims()
                ),
            });
        }
        let sum = (w.detach().to_dtype(d.dtype())? + (d * sign)?)?;
        Ok(sum.to_dtype(w.dtype())?)
    }
}
