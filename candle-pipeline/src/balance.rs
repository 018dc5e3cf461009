//! Splitting a sequential stack of layers into contiguous stages of balanced cost.

use std::ops::Range;
use std::time::Instant;

use candle_core::{Tensor, Var};

use crate::error::{PipelineError, Result};
use crate::stage::{Layer, Sequential, Stage};

/// Splits `costs` (one per layer, in order) into `parts` contiguous, non-empty ranges minimising
/// the largest range sum (exact dynamic programme, `O(parts * n^2)`).
///
/// ```
/// let r = candle_pipeline::balance_by_cost(&[1.0, 1.0, 1.0, 3.0], 2).unwrap();
/// assert_eq!(r, vec![0..3, 3..4]);
/// ```
pub fn balance_by_cost(costs: &[f64], parts: usize) -> Result<Vec<Range<usize>>> {
    let n = costs.len();
    if parts == 0 || parts > n {
        return Err(PipelineError::Config(format!(
            "cannot split {n} layers into {parts} non-empty stages"
        )));
    }
    if costs.iter().any(|c| !c.is_finite() || *c < 0.0) {
        return Err(PipelineError::Config(
            "layer costs must be finite and >= 0".into(),
        ));
    }
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(costs.iter().scan(0.0, |s, c| {
            *s += c;
            Some(*s)
        }))
        .collect();
    // best[p][i]: minimal max-sum splitting the first i layers into p parts; cut[p][i]: last cut.
    let mut best = vec![vec![f64::INFINITY; n + 1]; parts + 1];
    let mut cut = vec![vec![0usize; n + 1]; parts + 1];
    best[0][0] = 0.0;
    for p in 1..=parts {
        for i in p..=n {
            for j in (p - 1)..i {
                let v = best[p - 1][j].max(prefix[i] - prefix[j]);
                if v < best[p][i] {
                    best[p][i] = v;
                    cut[p][i] = j;
                }
            }
        }
    }
    let mut ranges = vec![0..0; parts];
    let mut end = n;
    for p in (1..=parts).rev() {
        let start = cut[p][end];
        ranges[p - 1] = start..end;
        end = start;
    }
    Ok(ranges)
}

/// Balances by number of parameters per layer.
pub fn balance_by_params(layers: &[Layer], parts: usize) -> Result<Vec<Range<usize>>> {
    let costs: Vec<f64> = layers.iter().map(|l| l.num_params() as f64).collect();
    balance_by_cost(&costs, parts)
}

/// Measures forward + backward time of every layer on `sample` (the input of the first layer;
/// each layer's output feeds the next), taking the median over `reps` repetitions after one
/// warm-up run. Run it on the device and thread pool the stages will use.
pub fn measure_layer_times(layers: &[Layer], sample: &Tensor, reps: usize) -> Result<Vec<f64>> {
    let mut times = vec![vec![]; layers.len()];
    for rep in 0..=reps.max(1) {
        let mut x = sample.clone();
        for (i, l) in layers.iter().enumerate() {
            let t = Instant::now();
            let input = if x.dtype().is_float() {
                Var::from_tensor(&x)?.as_tensor().clone()
            } else {
                x.clone()
            };
            let y = l.forward(&input)?;
            if y.dtype().is_float() {
                y.sum_all()?.backward()?;
            }
            if rep > 0 {
                times[i].push(t.elapsed().as_secs_f64());
            }
            x = y.detach();
        }
    }
    Ok(times
        .into_iter()
        .map(|mut t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect())
}

/// Balances by measured forward + backward time, see [`measure_layer_times`].
pub fn balance_by_time(
    layers: &[Layer],
    sample: &Tensor,
    parts: usize,
    reps: usize,
) -> Result<Vec<Range<usize>>> {
    balance_by_cost(&measure_layer_times(layers, sample, reps)?, parts)
}

/// Groups `layers` into one [`Sequential`] stage per range (ranges must cover `0..layers.len()`
/// contiguously, as returned by the `balance_*` functions).
pub fn split_layers(layers: Vec<Layer>, ranges: &[Range<usize>]) -> Result<Vec<Sequential>> {
    let mut expected = 0;
    for r in ranges {
        if r.start != expected || r.end <= r.start {
            return Err(PipelineError::Config(format!(
                "ranges {ranges:?} do not cover the layers contiguously"
            )));
        }
        expected = r.end;
    }
    if expected != layers.len() {
        return Err(PipelineError::Config(format!(
            "ranges cover {expected} layers, there are {}",
            layers.len()
        )));
    }
    let mut it = layers.into_iter();
    Ok(ranges
        .iter()
        .map(|r| Sequential::new(it.by_ref().take(r.len()).collect()))
        .collect())
}

/// Splits `layers` into `parts` stages balanced by parameter count, boxed for
/// [`crate::Pipeline::new`].
pub fn split_by_params(layers: Vec<Layer>, parts: usize) -> Result<Vec<Box<dyn Stage>>> {
    let ranges = balance_by_params(&layers, parts)?;
    Ok(split_layers(layers, &ranges)?
        .into_iter()
        .map(|s| Box::new(s) as Box<dyn Stage>)
        .collect())
}
