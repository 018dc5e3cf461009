//! Fused linear + cross-entropy: the chunked op against the unchunked composite (loss and the
//! gradients of x and w) for every dtype, chunk sizes around the row count, odd vocabularies,
//! ignored rows (scattered, a run longer than a chunk, all of them), strided views of x and w
//! (a transposed / narrowed x, a narrowed / transposed tied weight), the fallback path, a
//! second backward, NaN propagation, thread-count determinism, bad input; in
//! `linear_cross_entropy/memory_and_cuda.rs` the peak memory of forward + backward (this binary
//! counts its heap with `test_support::alloc`) and the op on a CUDA device.
//!
//! Tolerances (relative to max(largest magnitude of the reference, 1e-3), `common::assert_close`;
//! the largest errors measured are in brackets):
//! * f64: 1e-12 [3e-15]: the same sums in another order (the crate's GEMM bands and 8-lane row
//!   sums against Candle's matmul and reductions).
//! * f32: 1e-6 on the loss [8e-8], 1e-5 on the gradients [1.5e-6]: that reordering in f32
//!   (sums of C or V terms) and the kernel's exp (< 1 ulp) against Candle's.
//! * bf16 / f16 against the composite in the same dtype: both round each logit to the 16-bit
//!   type after an f32 GEMM (a logit lands one 16-bit unit away only where the two summation
//!   orders straddle a rounding boundary), so the loss (f32) within 1e-5 [8e-8]. Both round the
//!   logit gradients to 16 bits before the two GEMMs and dx, dW once (dW after accumulating in
//!   f32 here, inside one GEMM there): bf16 1.5e-2 [7e-3], two units of bf16 (2^-8). f16 1e-2
//!   [6.4e-3]: Candle's f16 matmul of a single row is the less exact side (6.7e-3 from the f64
//!   reference where the op is 3e-4 from it), otherwise 2e-3.
//! * bf16 / f16 against the composite in f64 on the same (exactly widened) values, what the op
//!   rounds away: loss 2e-3 / 5e-4 [7.7e-4 / 6.5e-5], gradients 1.5e-2 / 2e-3 [6.4e-3 / 8.3e-4].
//! * finite differences (f64, h = 1e-5): 1e-6.

mod common;
// The peak-memory test and the CUDA test.
#[path = "linear_cross_entropy/memory_and_cuda.rs"]
mod memory_and_cuda;

use std::sync::{Mutex, MutexGuard};

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::linear_cross_entropy::{
    linear_cross_entropy, linear_cross_entropy_chunked, linear_cross_entropy_composite,
};
use common::*;
use test_support::alloc::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// The loss's dtype (and of the upstream gradient) for inputs of `dt`.
fn acc(dt: DType) -> DType {
    if dt == DType::F64 {
        dt
    } else {
        DType::F32
    }
}

/// The heap counters are process-wide: the tests of this binary run one at a time, so the
/// memory test sees only its own allocations.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// How the op sees its inputs: `x` and `w` are views of the differentiated base tensors.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Views {
    /// x and w as they are.
    Plain,
    /// x = base[C, N]ᵀ (column-major), w = base[V + 5, C] rows 3 .. V + 3.
    TransposedX,
    /// x = base[.., C + 3] columns 2 .. C + 2, w = base[C, V]ᵀ (a tied weight stored
    /// transposed: strides (1, V)).
    NarrowedX,
}

impl Views {
    /// Shapes of the base tensors for x `[lead.., c]` and w `[v, c]`.
    fn bases(self, lead: &[usize], c: usize, v: usize) -> (Vec<usize>, Vec<usize>) {
        let n: usize = lead.iter().product();
        match self {
            Views::Plain => ([lead, &[c]].concat(), vec![v, c]),
            Views::TransposedX => (vec![c, n], vec![v + 5, c]),
            Views::NarrowedX => ([lead, &[c + 3]].concat(), vec![c, v]),
        }
    }

    fn apply(self, ins: &[Tensor], c: usize, v: usize) -> candle_core::Result<(Tensor, Tensor)> {
        Ok(match self {
            Views::Plain => (ins[0].clone(), ins[1].clone()),
            Views::TransposedX => (ins[0].t()?, ins[1].narrow(0, 3, v)?),
            Views::NarrowedX => {
                let r = ins[0].rank();
                (ins[0].narrow(r - 1, 2, c)?, ins[1].t()?)
            }
        })
    }
}

/// One case: shapes, chunk size (`None`: the default), ignore index and views.
struct Case {
    lead: Vec<usize>,
    c: usize,
    v: usize,
    chunk: Option<usize>,
    ignore: Option<u32>,
    views: Views,
    targets: Tensor,
}

impl Case {
    /// Random targets; with `ignore`, the rows in `ignored` get it, and about a fifth of the
    /// others.
    fn new(
        (lead, c, v): (&[usize], usize, usize),
        (chunk, ignore): (Option<usize>, Option<u32>),
        ignored: &[usize],
        rng: &mut Lcg,
    ) -> Result<Self> {
        let n: usize = lead.iter().product();
        let t: Vec<u32> = (0..n)
            .map(|i| match ignore {
                Some(ig) if ignored.contains(&i) || rng.below(5) == 0 => ig,
                _ => rng.below(v) as u32,
            })
            .collect();
        Ok(Self {
            lead: lead.to_vec(),
            c,
            v,
            chunk,
            ignore,
            views: Views::Plain,
            targets: Tensor::from_vec(t, lead, &Device::Cpu)?,
        })
    }

    fn viewed(self, views: Views) -> Self {
        Self { views, ..self }
    }

    fn inputs(&self, dt: DType, rng: &mut Lcg) -> Result<[Tensor; 2]> {
        let (xs, ws) = self.views.bases(&self.lead, self.c, self.v);
        // Logits of standard deviation about 1.5.
        let amp = 4.0 / (self.c as f64).sqrt();
        Ok([rand(&xs, dt, rng, 1.0, 0.0)?, rand(&ws, dt, rng, amp, 0.0)?])
    }

    fn fused(&self) -> impl Fn(&[Tensor]) -> candle_core::Result<Tensor> + Sync + '_ {
        move |ins: &[Tensor]| {
            let (x, w) = self.views.apply(ins, self.c, self.v)?;
            match self.chunk {
                Some(k) => linear_cross_entropy_chunked(&x, &w, &self.targets, self.ignore, k),
                None => linear_cross_entropy(&x, &w, &self.targets, self.ignore),
            }
        }
    }

    fn reference(&self) -> impl Fn(&[Tensor]) -> candle_core::Result<Tensor> + Sync + '_ {
        move |ins: &[Tensor]| {
            let (x, w) = self.views.apply(ins, self.c, self.v)?;
            linear_cross_entropy_composite(&x, &w, &self.targets, self.ignore)
        }
    }

    fn name(&self, dt: DType) -> String {
        format!(
            "{dt:?} lead {:?} C {} V {} chunk {:?} ignore {:?} {:?}",
            self.lead, self.c, self.v, self.chunk, self.ignore, self.views
        )
    }
}

/// The cases every dtype runs: N = 10 or 13 rows, V = 311 (odd), chunks of 1, 3 (N not a
/// multiple), >= N and the default; ignored rows away from row 0, among them a run of 7
/// consecutive rows (longer than a chunk of 3); strided views of x and w.
fn cases(rng: &mut Lcg) -> Result<Vec<Case>> {
    let ig = Some(7u32); // an in-range class id as the ignore index
    let run: Vec<usize> = (3..10).collect();
    let mut v = Vec::new();
    for (lead, chunk, ignore, ignored, views) in [
        (&[2usize, 5][..], Some(3), None, &[][..], Views::Plain),
        (&[2, 5], Some(1), ig, &[4][..], Views::Plain),
        (&[13], Some(3), ig, &run[..], Views::Plain),
        (&[13], Some(64), Some(u32::MAX), &[1, 12][..], Views::Plain),
        (&[13], None, ig, &[2][..], Views::Plain),
        (&[13], Some(4), ig, &[5][..], Views::TransposedX),
        (&[3, 4], Some(5), ig, &[6][..], Views::NarrowedX),
        (&[1], Some(1), None, &[][..], Views::Plain),
    ] {
        v.push(Case::new((lead, 24, 311), (chunk, ignore), ignored, rng)?.viewed(views));
    }
    Ok(v)
}

/// Loss and both gradients of the op against the composite, with an upstream gradient of 1
/// (the gradients computed in the forward handed out as they are) and of 1.7 (scaled in place);
/// for 16-bit inputs also against the composite in f64 on the same values (`exact`).
fn check_against_composite(
    dt: DType,
    (loss_tol, grad_tol): (f64, f64),
    exact: Option<(f64, f64)>,
    seed: u64,
) -> Result<()> {
    let mut rng = Lcg(seed);
    for case in cases(&mut rng)? {
        let ins = case.inputs(dt, &mut rng)?;
        for g in [1.0, 1.7] {
            let probe = Tensor::new(g, &Device::Cpu)?.to_dtype(acc(dt))?;
            let (y, gr) = value_and_grads(&case.fused(), &ins, &probe)?;
            let (yr, grr) = value_and_grads(&case.reference(), &ins, &probe)?;
            let what = format!("{} g {g}", case.name(dt));
            assert_eq!((y.dtype(), y.rank()), (acc(dt), 0), "{what}");
            assert_close(&y, &yr, loss_tol, &format!("{what} loss"))?;
            for (k, name) in ["dx", "dw"].iter().enumerate() {
                assert_eq!(gr[k].dtype(), dt, "{what} {name}");
                assert_close(&gr[k], &grr[k], grad_tol, &format!("{what} {name}"))?;
            }
            if let Some((lt, gt)) = exact {
                let wide: Vec<Tensor> = ins
                    .iter()
                    .map(|t| t.to_dtype(DType::F64))
                    .collect::<candle_core::Result<_>>()?;
                let probe = Tensor::new(g, &Device::Cpu)?;
                let (ye, ge) = value_and_grads(&case.reference(), &wide, &probe)?;
                let what = format!("{what} vs f64");
                assert_close(&y.to_dtype(DType::F64)?, &ye, lt, &format!("{what} loss"))?;
                for (k, name) in ["dx", "dw"].iter().enumerate() {
                    let a = gr[k].to_dtype(DType::F64)?;
                    assert_close(&a, &ge[k], gt, &format!("{what} {name}"))?;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn matches_composite_f64() -> Result<()> {
    let _s = serial();
    check_against_composite(DType::F64, (1e-12, 1e-12), None, 1)
}

#[test]
fn matches_composite_f32() -> Result<()> {
    let _s = serial();
    check_against_composite(DType::F32, (1e-6, 1e-5), None, 2)
}

#[test]
fn matches_composite_bf16() -> Result<()> {
    let _s = serial();
    check_against_composite(DType::BF16, (1e-5, 1.5e-2), Some((2e-3, 1.5e-2)), 3)
}

#[test]
fn matches_composite_f16() -> Result<()> {
    let _s = serial();
    check_against_composite(DType::F16, (1e-5, 1e-2), Some((5e-4, 2e-3)), 4)
}

#[test]
fn fallback_matches_kernel() -> Result<()> {
    let _s = serial();
    // The fallback runs the same chunk loop from Candle ops: the tolerances against the
    // composite (f64, f32, bf16) hold between the two paths too.
    let mut rng = Lcg(5);
    for (dt, tol) in [
        (DType::F64, 1e-12),
        (DType::F32, 1e-5),
        (DType::BF16, 1.5e-2),
    ] {
        for case in cases(&mut rng)? {
            let ins = case.inputs(dt, &mut rng)?;
            let probe = Tensor::new(1.3f64, &Device::Cpu)?.to_dtype(acc(dt))?;
            assert_fallback_matches(&case.fused(), &ins, &probe, tol, &case.name(dt))?;
        }
    }
    Ok(())
}

#[test]
fn tied_embedding_gets_both_gradients() -> Result<()> {
    let _s = serial();
    // One [V, C] table is the embedding that makes x and the head's weight: its gradient is the
    // sum over both uses (f32 tolerances).
    let mut rng = Lcg(13);
    let (v, c, n) = (61usize, 12usize, 9usize);
    let case = Case::new((&[n], c, v), (Some(4), Some(3)), &[2], &mut rng)?;
    let ids: Vec<u32> = (0..n).map(|_| rng.below(v) as u32).collect();
    let ids = Tensor::from_vec(ids, n, &Device::Cpu)?;
    let table = [rand(&[v, c], DType::F32, &mut rng, 1.0, 0.0)?];
    let (t, ig) = (&case.targets, case.ignore);
    let x = |e: &Tensor| e.index_select(&ids, 0)? * 0.5;
    let fused = |e: &[Tensor]| linear_cross_entropy_chunked(&x(&e[0])?, &e[0], t, ig, 4);
    let reference = |e: &[Tensor]| linear_cross_entropy_composite(&x(&e[0])?, &e[0], t, ig);
    let probe = Tensor::new(1f32, &Device::Cpu)?;
    let (y, g) = value_and_grads(&fused, &table, &probe)?;
    let (yr, gr) = value_and_grads(&reference, &table, &probe)?;
    assert_close(&y, &yr, 1e-6, "tied loss")?;
    assert_close(&g[0], &gr[0], 1e-5, "tied gradient")
}

#[test]
fn finite_differences_f64() -> Result<()> {
    let _s = serial();
    let mut rng = Lcg(6);
    for (chunk, ignore, views) in [
        (Some(2), Some(1u32), Views::Plain),
        (Some(1), None, Views::TransposedX),
        (None, Some(0), Views::NarrowedX),
    ] {
        let case = Case::new((&[5], 3, 7), (chunk, ignore), &[3], &mut rng)?.viewed(views);
        let ins = case.inputs(DType::F64, &mut rng)?;
        check_fd(&case.fused(), &ins, 60)?;
    }
    Ok(())
}

#[test]
fn second_backward_recomputes_the_same_gradients() -> Result<()> {
    let _s = serial();
    let mut rng = Lcg(7);
    for fallback in [false, true] {
        for dt in [DType::F32, DType::F64] {
            let case = Case::new((&[11], 16, 97), (Some(4), Some(3)), &[5, 6], &mut rng)?;
            let [x, w] = case.inputs(dt, &mut rng)?;
            let (xv, wv) = (Var::from_tensor(&x)?, Var::from_tensor(&w)?);
            let what = format!("{dt:?} fallback {fallback}");
            fallback_if(fallback, || -> Result<()> {
                let loss = case.fused()(&[xv.as_tensor().clone(), wv.as_tensor().clone()])?;
                let scaled = (&loss * 0.5)?;
                let first = scaled.backward()?;
                let second = scaled.backward()?;
                for v in [&xv, &wv] {
                    let (a, b) = (first.get(v).expect("grad"), second.get(v).expect("grad"));
                    assert_close(b, a, 1e-12, &what)?;
                }
                Ok(())
            })?;
        }
    }
    Ok(())
}

/// On the fallback path (a device's, forced on the CPU) the upstream gradient is not read back
/// to the host (a sync at the start of every backward on a GPU): it scales the gradients where
/// it lives. The same values as the composite, for g = 1.7, first and second backward.
#[test]
fn fallback_scales_by_the_upstream_gradient_without_reading_it() -> Result<()> {
    let _s = serial();
    let mut rng = Lcg(9);
    for dt in [DType::F32, DType::F64] {
        let case = Case::new((&[13], 16, 97), (Some(4), Some(3)), &[2, 7], &mut rng)?;
        let ins = case.inputs(dt, &mut rng)?;
        let probe = Tensor::new(1.7, &Device::Cpu)?.to_dtype(acc(dt))?;
        let (yr, grr) = value_and_grads(&case.reference(), &ins, &probe)?;
        fallback_if(true, || -> Result<()> {
            let (y, gr) = value_and_grads(&case.fused(), &ins, &probe)?;
            assert_close(&y, &yr, 1e-6, &format!("{dt:?} loss"))?;
            for (k, name) in ["dx", "dw"].iter().enumerate() {
                assert_close(&gr[k], &grr[k], 1e-5, &format!("{dt:?} {name}"))?;
            }
            Ok(())
        })?;
    }
    Ok(())
}

#[test]
fn detached_inputs_give_the_same_loss_bits() -> Result<()> {
    let _s = serial();
    let mut rng = Lcg(8);
    let case = Case::new((&[2, 9], 32, 257), (Some(5), Some(2)), &[], &mut rng)?;
    for dt in [DType::F32, DType::BF16] {
        let ins = case.inputs(dt, &mut rng)?;
        let vars: Vec<Tensor> = ins
            .iter()
            .map(|t| Ok(Var::from_tensor(t)?.as_tensor().clone()))
            .collect::<Result<_>>()?;
        let tracked = case.fused()(&vars)?;
        let plain = case.fused()(&ins)?;
        same_bits(&tracked, &plain, &format!("{dt:?}"))?;
    }
    Ok(())
}

#[test]
fn all_targets_ignored_give_zero_loss_and_gradients() -> Result<()> {
    let _s = serial();
    let mut rng = Lcg(9);
    let all: Vec<usize> = (0..6).collect();
    for fallback in [false, true] {
        for dt in [DType::F32, DType::BF16] {
            let case = Case::new((&[6], 8, 31), (Some(2), Some(30)), &all, &mut rng)?;
            let ins = case.inputs(dt, &mut rng)?;
            let probe = Tensor::new(1f32, &Device::Cpu)?;
            let (y, g) = fallback_if(fallback, || value_and_grads(&case.fused(), &ins, &probe))?;
            let what = format!("{dt:?} fallback {fallback}");
            assert_eq!(values(&y), [0.0], "{what}");
            for g in &g {
                assert!(
                    values(g).iter().all(|v| *v == 0.0),
                    "{what}: nonzero gradient"
                );
            }
            let r = case.reference()(&ins)?;
            assert_eq!(values(&r), [0.0], "{what}: reference");
        }
    }
    Ok(())
}

#[test]
fn nan_in_a_counted_row_propagates_and_an_ignored_row_is_skipped() -> Result<()> {
    let _s = serial();
    let mut rng = Lcg(10);
    let (n, c, v) = (9usize, 16usize, 53usize);
    for dt in [DType::F32, DType::F64, DType::BF16] {
        for fallback in [false, true] {
            // A NaN at a random element of a counted row (never element 0), and one in the
            // ignored row 6.
            let case = Case::new((&[n], c, v), (Some(4), Some(99)), &[6], &mut rng)?;
            let counted: Vec<usize> = values(&case.targets)
                .iter()
                .enumerate()
                .filter(|(i, t)| **t != 99.0 && *i > 0)
                .map(|(i, _)| i)
                .collect();
            let row = counted[rng.below(counted.len())];
            let [x, w] = case.inputs(DType::F64, &mut rng)?;
            let mut xv = values(&x);
            xv[6 * c + rng.below(c)] = f64::NAN;
            let clean = Tensor::from_vec(xv.clone(), (n, c), &Device::Cpu)?.to_dtype(dt)?;
            xv[row * c + rng.below(c)] = f64::NAN;
            let dirty = Tensor::from_vec(xv, (n, c), &Device::Cpu)?.to_dtype(dt)?;
            let w = w.to_dtype(dt)?;
            let what = format!("{dt:?} fallback {fallback} NaN row {row}");
            let probe = Tensor::new(1f64, &Device::Cpu)?.to_dtype(acc(dt))?;
            let run = |x: &Tensor| value_and_grads(&case.fused(), &[x.clone(), w.clone()], &probe);
            let (r_clean, r_dirty) = fallback_if(fallback, || (run(&clean), run(&dirty)));
            let ((l_clean, g_clean), (l_dirty, g_dirty)) = (r_clean?, r_dirty?);
            // The ignored row's NaN is skipped: finite loss and gradients, a zero dx row.
            assert!(values(&l_clean)[0].is_finite(), "{what}: clean loss");
            assert_eq!(nan_count(&g_clean[0]) + nan_count(&g_clean[1]), 0, "{what}");
            let dx = values(&g_clean[0]);
            assert!(
                dx[6 * c..7 * c].iter().all(|v| *v == 0.0),
                "{what}: dx row 6"
            );
            // The counted row's is not.
            assert!(values(&l_dirty)[0].is_nan(), "{what}: loss");
            let dx = nans(&g_dirty[0]);
            for r in 0..n {
                let k = dx[r * c..(r + 1) * c].iter().filter(|b| **b).count();
                assert_eq!(
                    k,
                    if r == row { c } else { 0 },
                    "{what}: NaNs in dx row {r}"
                );
            }
            assert_eq!(nan_count(&g_dirty[1]), v * c, "{what}: dw");
        }
    }
    Ok(())
}

#[test]
fn same_bits_on_any_thread_count() -> Result<()> {
    let _s = serial();
    let mut rng = Lcg(11);
    // 16-row chunks of 4099 logits: 16 x 4 x 4099 > PAR_MIN_WORK, so the row loop and the
    // GEMMs run in parallel.
    let v = 4099;
    assert!(16 * 4 * v > PAR_MIN_WORK);
    for chunk in [Some(16), None] {
        let case = Case::new((&[2, 50], 64, v), (chunk, Some(5)), &[], &mut rng)?;
        for dt in [DType::F32, DType::BF16, DType::F64] {
            let ins = case.inputs(dt, &mut rng)?;
            let probe = Tensor::new(0.75f64, &Device::Cpu)?.to_dtype(acc(dt))?;
            assert_same_bits_on_thread_counts(&case.fused(), &ins, &probe, &case.name(dt))?;
        }
    }
    Ok(())
}

#[test]
fn rejects_bad_targets_and_shapes() -> Result<()> {
    let _s = serial();
    let dev = Device::Cpu;
    let x = Tensor::zeros((3, 4), DType::F32, &dev)?;
    let w = Tensor::zeros((5, 4), DType::F32, &dev)?;
    let bad = Tensor::new(&[0u32, 5, 1], &dev)?;
    for fallback in [false, true] {
        let (e, ec, ok) = fallback_if(fallback, || {
            (
                linear_cross_entropy(&x, &w, &bad, None),
                linear_cross_entropy_chunked(&x, &w, &bad, Some(3), 2),
                linear_cross_entropy(&x, &w, &bad, Some(5)),
            )
        });
        let e = e.unwrap_err().to_string();
        assert!(
            e.starts_with("linear_cross_entropy: target 5 (row 1) is out of range for 5 classes"),
            "{e}"
        );
        let e = ec.unwrap_err().to_string();
        assert!(
            e.contains("linear_cross_entropy_chunked: target 5 (row 1)")
                && e.contains("not ignore_index 3"),
            "{e}"
        );
        assert!((ok?.to_scalar::<f32>()? - 5f32.ln()).abs() < 1e-6);
    }
    let e = linear_cross_entropy_composite(&x, &w, &bad, None).unwrap_err();
    assert!(
        e.to_string()
            .contains("linear_cross_entropy_composite: target 5"),
        "{e}"
    );
    let t = Tensor::new(&[0u32, 1, 2], &dev)?;
    let (x0, w0) = (x.narrow(1, 0, 0)?, w.narrow(1, 0, 0)?);
    let w3 = w.unsqueeze(0)?;
    let (scalar, xi) = (Tensor::new(1f32, &dev)?, x.to_dtype(DType::U32)?);
    let (t2, ti) = (t.narrow(0, 0, 2)?, t.to_dtype(DType::I64)?);
    let wd = w.to_dtype(DType::F64)?;
    for (r, needle) in [
        (
            linear_cross_entropy(&x, &w.t()?, &t, None),
            "w must be [V, C]",
        ),
        (
            linear_cross_entropy(&x, &w.flatten_all()?, &t, None),
            "w must be",
        ),
        (linear_cross_entropy(&x, &w3, &t, None), "w must be"),
        (linear_cross_entropy(&x, &w, &t2, None), "leading shape"),
        (
            linear_cross_entropy(&x, &w, &ti, None),
            "targets must be u32",
        ),
        (
            linear_cross_entropy(&x, &wd, &t, None),
            "w dtype F64 differs from x dtype F32",
        ),
        (
            linear_cross_entropy_chunked(&x, &w, &t, None, 0),
            "chunk_rows",
        ),
        (linear_cross_entropy(&x0, &w0, &t, None), "C > 0"),
        (linear_cross_entropy(&scalar, &w, &t, None), "C > 0"),
        (linear_cross_entropy(&xi, &w, &t, None), "float"),
    ] {
        let e = r.expect_err(needle).to_string();
        assert!(
            e.starts_with("linear_cross_entropy") && e.contains(needle),
            "{e}"
        );
    }
    Ok(())
}
