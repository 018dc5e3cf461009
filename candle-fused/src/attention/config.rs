//! The options of [`super`] ([`AttentionConfig`]) and their checks against the inputs' shapes.

use crate::op::acc_dtype;
use crate::RngKey;
use candle_core::{bail, DType, Result, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// Options of [`attention`](super::attention) / [`attention_merged`](super::attention_merged) /
/// [`attention_qkv`](super::attention_qkv).
///
/// Which keys query `i` sees (absolute position `i_abs = i + Tk - Tq`: the queries are the last
/// `Tq` positions of the keys' sequence, as when decoding with a KV cache): all of them, minus
/// those `causal` masks (`j > i_abs`), those outside the sliding `window` (`i_abs - j >= w`),
/// those of another document (`doc_ids[b, i_abs] != doc_ids[b, j]`) and those the additive
/// `mask` sets to `-inf`.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::attention::AttentionConfig;
/// // Two packed examples of lengths 3 and 2 in one row, Mistral's sliding window of 4.
/// let ids = Tensor::new(&[[0u32, 0, 0, 1, 1]], &Device::Cpu)?;
/// let cfg = AttentionConfig::causal().with_window(4).with_doc_ids(ids);
/// assert_eq!(cfg.window, Some(4));
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct AttentionConfig {
    /// Query `i` sees keys `0 ..= i + Tk - Tq` only.
    pub causal: bool,
    /// Score scale; `None` means `1 / sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// Additive mask `[Tq, Tk]` (any float dtype; `-inf` masks out), broadcast over batch and
    /// heads; not differentiated.
    pub mask: Option<Tensor>,
    /// Dropout probability on the attention probabilities, in `[0, 1)`.
    pub dropout: f32,
    /// Where the dropout mask comes from.
    pub key: RngKey,
    /// Sliding window (with `causal` only): query `i_abs` sees key `j` iff `i_abs - j < w`
    /// (itself and the `w - 1` keys before it; transformers' / Mistral's `sliding_window`).
    /// Key blocks outside every row's window are skipped, so the cost is `O(T w)`.
    pub window: Option<usize>,
    /// Per-token document ids `[B, Tk]` (u32): query `i_abs` of batch row `b` sees key `j`
    /// only if `doc_ids[b, i_abs] == doc_ids[b, j]` (packed examples attend within their own
    /// example). Needs `Tq <= Tk`; not differentiated.
    pub doc_ids: Option<Tensor>,
}

impl AttentionConfig {
    /// Causal attention, default scale, no mask, no dropout, no window, no document ids.
    ///
    /// ```
    /// let cfg = candle_fused::attention::AttentionConfig::causal();
    /// assert!(cfg.causal && cfg.window.is_none() && cfg.doc_ids.is_none());
    /// ```
    pub fn causal() -> Self {
        AttentionConfig {
            causal: true,
            scale: None,
            mask: None,
            dropout: 0.0,
            key: RngKey::new(0, 0),
            window: None,
            doc_ids: None,
        }
    }

    /// Non-causal (full) attention, default scale, no mask, no dropout.
    ///
    /// ```
    /// assert!(!candle_fused::attention::AttentionConfig::full().causal);
    /// ```
    pub fn full() -> Self {
        AttentionConfig {
            causal: false,
            ..Self::causal()
        }
    }

    /// Sets causal masking on or off.
    ///
    /// ```
    /// use candle_fused::attention::AttentionConfig;
    /// assert!(!AttentionConfig::causal().with_causal(false).causal);
    /// ```
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Dropout with probability `p` on the probabilities, drawn from `key`.
    ///
    /// ```
    /// use candle_fused::{attention::AttentionConfig, RngKey};
    /// assert_eq!(AttentionConfig::causal().with_dropout(0.1, RngKey::new(1, 0)).dropout, 0.1);
    /// ```
    pub fn with_dropout(mut self, p: f32, key: RngKey) -> Self {
        self.dropout = p;
        self.key = key;
        self
    }

    /// An additive `[Tq, Tk]` mask.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use candle_fused::attention::AttentionConfig;
    /// let m = Tensor::zeros((3, 3), candle_core::DType::F32, &Device::Cpu)?;
    /// assert!(AttentionConfig::full().with_mask(m).mask.is_some());
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn with_mask(mut self, mask: Tensor) -> Self {
        self.mask = Some(mask);
        self
    }

    /// The score scale (instead of `1 / sqrt(head_dim)`).
    ///
    /// ```
    /// use candle_fused::attention::AttentionConfig;
    /// assert_eq!(AttentionConfig::causal().with_scale(0.5).scale, Some(0.5));
    /// ```
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }

    /// A sliding window of `w >= 1` keys (the query's own position and the `w - 1` before it);
    /// needs causal masking.
    ///
    /// ```
    /// use candle_fused::attention::AttentionConfig;
    /// assert_eq!(AttentionConfig::causal().with_window(128).window, Some(128));
    /// ```
    pub fn with_window(mut self, w: usize) -> Self {
        self.window = Some(w);
        self
    }

    /// Per-token document ids `[B, Tk]` (u32): attention stays within each document.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use candle_fused::attention::AttentionConfig;
    /// let ids = Tensor::new(&[[0u32, 0, 1, 2, 2]], &Device::Cpu)?;
    /// assert!(AttentionConfig::causal().with_doc_ids(ids).doc_ids.is_some());
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn with_doc_ids(mut self, ids: Tensor) -> Self {
        self.doc_ids = Some(ids);
        self
    }
}

/// The spans of the documents of a CPU call, `[B, Tk]` each: what the kernel reads.
#[derive(Debug)]
pub(super) struct HostDocs {
    /// The ids.
    pub ids: Vec<u32>,
    /// `first[b * Tk + p]`: the first position of row `b` with the id of position `p`.
    pub first: Vec<u32>,
    /// `last[b * Tk + p]`: the last position of row `b` with the id of position `p`.
    pub last: Vec<u32>,
    /// `runs[b]`: every id of row `b` occupies one contiguous run of positions (then the keys
    /// `first ..= last` of a position are exactly those of its document).
    pub runs: Vec<bool>,
}

impl HostDocs {
    fn new(ids: Vec<u32>, b: usize, tk: usize) -> Self {
        let (mut first, mut last) = (vec![0u32; b * tk], vec![0u32; b * tk]);
        let mut runs = vec![true; b];
        let mut span: HashMap<u32, (u32, u32)> = HashMap::new();
        for r in 0..b {
            span.clear();
            let row = &ids[r * tk..(r + 1) * tk];
            let mut n_runs = 0;
            for (p, &id) in row.iter().enumerate() {
                let e = span.entry(id).or_insert((p as u32, p as u32));
                e.1 = p as u32;
                if p == 0 || row[p - 1] != id {
                    n_runs += 1;
                }
            }
            runs[r] = n_runs == span.len();
            for (p, id) in row.iter().enumerate() {
                let (f, l) = span[id];
                first[r * tk + p] = f;
                last[r * tk + p] = l;
            }
        }
        HostDocs {
            ids,
            first,
            last,
            runs,
        }
    }
}

/// The configuration checked against the shapes: scale resolved, mask detached, `[Tq, Tk]`,
/// contiguous, on the inputs' device, in the accumulation dtype; document ids detached,
/// contiguous, on the inputs' device (and their spans on the host for a CPU call).
#[derive(Clone, Debug)]
pub(super) struct Resolved {
    pub causal: bool,
    pub scale: f64,
    pub mask: Option<Tensor>,
    pub dropout: f32,
    pub key: RngKey,
    pub window: Option<usize>,
    pub doc_ids: Option<Tensor>,
    pub host_docs: Option<Arc<HostDocs>>,
}

/// Checks `cfg` against a call of op `name` with batch `b`, head dim `d`, `tq` queries and
/// `tk` keys on inputs like `x`.
pub(super) fn resolve(
    name: &str,
    cfg: &AttentionConfig,
    (b, d, tq, tk): (usize, usize, usize, usize),
    x: &Tensor,
) -> Result<Resolved> {
    if !matches!(
        x.dtype(),
        DType::F32 | DType::F64 | DType::BF16 | DType::F16
    ) {
        bail!("{name}: expected a float dtype, got {:?}", x.dtype())
    }
    if d == 0 {
        bail!("{name}: head dimension must be positive")
    }
    let p = cfg.dropout;
    if !(0.0..1.0).contains(&p) {
        bail!("{name}: dropout must be in [0, 1), got {p}")
    }
    match cfg.window {
        Some(0) => bail!("{name}: window must be at least 1, got 0"),
        Some(w) if !cfg.causal => {
            bail!("{name}: a sliding window ({w}) needs causal attention")
        }
        _ => {}
    }
    let scale = cfg.scale.unwrap_or(1.0 / (d as f64).sqrt());
    let mask = match &cfg.mask {
        None => None,
        Some(m) => {
            let dims = m.dims();
            let n = dims.len();
            if n < 2
                || dims[n - 2] != tq
                || dims[n - 1] != tk
                || dims[..n - 2].iter().any(|&x| x != 1)
            {
                bail!(
                    "{name}: mask must be [Tq, Tk] = [{tq}, {tk}], got {:?}",
                    m.shape()
                )
            }
            let m = m.detach().reshape((tq, tk))?.to_device(x.device())?;
            Some(m.to_dtype(acc_dtype(x.dtype()))?.contiguous()?)
        }
    };
    let (doc_ids, host_docs) = match &cfg.doc_ids {
        None => (None, None),
        Some(ids) => {
            if ids.dims() != [b, tk] || ids.dtype() != DType::U32 {
                bail!(
                    "{name}: doc_ids must be u32 [B, Tk] = [{b}, {tk}], got {:?} {:?}",
                    ids.dtype(),
                    ids.shape()
                )
            }
            if tq > tk {
                bail!("{name}: doc_ids need Tq <= Tk (queries at the end), got Tq {tq} > Tk {tk}")
            }
            let ids = ids.detach().to_device(x.device())?.contiguous()?;
            let host = if x.device().is_cpu() {
                let v = ids.flatten_all()?.to_vec1::<u32>()?;
                Some(Arc::new(HostDocs::new(v, b, tk)))
            } else {
                None
            };
            (Some(ids), host)
        }
    };
    Ok(Resolved {
        causal: cfg.causal,
        scale,
        mask,
        dropout: p,
        key: cfg.key,
        window: cfg.window,
        doc_ids,
        host_docs,
    })
}

/// The sizes of a `[B, H, Tq, D]`, `[B, KV, Tk, D]`, `[B, KV, Tk, Dv]` call.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dims {
    pub b: usize,
    pub h: usize,
    pub kv: usize,
    pub tq: usize,
    pub tk: usize,
    pub d: usize,
    pub dv: usize,
}

/// The [`Dims`] of `q` `[B, H, Tq, D]`, `k` `[B, KV, Tk, D]`, `v` `[B, KV, Tk, Dv]` with
/// `H % KV == 0`, in op `name`.
pub(super) fn check_bhtd(name: &str, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Dims> {
    let shapes_err = || {
        candle_core::Error::Msg(format!(
            "{name}: expected q [B, H, Tq, D], k [B, KV, Tk, D], v [B, KV, Tk, Dv] with H a \
             multiple of KV, got {:?}, {:?}, {:?}",
            q.shape(),
            k.shape(),
            v.shape()
        ))
    };
    let ((b, h, tq, d), (bk, kv, tk, dk), (bv, kvv, tv, dv)) =
        match (q.dims4(), k.dims4(), v.dims4()) {
            (Ok(q), Ok(k), Ok(v)) => (q, k, v),
            _ => return Err(shapes_err()),
        };
    if (bk, dk) != (b, d) || (bv, kvv, tv) != (b, kv, tk) || kv == 0 || h % kv != 0 {
        return Err(shapes_err());
    }
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!(
            "{name}: q, k, v dtypes differ: {:?}, {:?}, {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype()
        )
    }
    if !k.device().same_device(q.device()) || !v.device().same_device(q.device()) {
        bail!("{name}: q, k, v must be on the same device")
    }
    Ok(Dims {
        b,
        h,
        kv,
        tq,
        tk,
        d,
        dv,
    })
}

/// `(B, T, C, D)` of a `[B, T, 3C]` fused projection with `n_head` heads.
pub(super) fn check_qkv(qkv: &Tensor, n_head: usize) -> Result<(usize, usize, usize, usize)> {
    let (b, t, c3) = qkv.dims3()?;
    if n_head == 0 || c3 % 3 != 0 || (c3 / 3) % n_head != 0 {
        bail!("attention_qkv: last dim {c3} must be 3 * n_head * head_dim with n_head = {n_head}")
    }
    Ok((b, t, c3 / 3, c3 / 3 / n_head))
}
