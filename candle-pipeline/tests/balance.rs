//! Balanced contiguous partitions.

use candle_core::{Device, Tensor};
use candle_pipeline::{
    balance_by_cost, balance_by_params, measure_layer_times, split_layers, Stage,
};
use rand::Rng;
use test_support::random::rng;

mod common;

fn brute_force(costs: &[f64], parts: usize) -> f64 {
    // Try every set of parts-1 cut points.
    fn rec(c: &[f64], parts: usize) -> f64 {
        if parts == 1 {
            return c.iter().sum();
        }
        (1..=c.len() - (parts - 1))
            .map(|i| c[..i].iter().sum::<f64>().max(rec(&c[i..], parts - 1)))
            .fold(f64::INFINITY, f64::min)
    }
    rec(costs, parts)
}

#[test]
fn balance_by_cost_is_optimal() {
    let mut rng = rng(3);
    for _ in 0..200 {
        let n = rng.random_range(1..9usize);
        let parts = rng.random_range(1..=n);
        let costs: Vec<f64> = (0..n).map(|_| rng.random_range(0..10) as f64).collect();
        let r = balance_by_cost(&costs, parts).unwrap();
        assert_eq!(r.len(), parts);
        assert_eq!(r[0].start, 0);
        assert_eq!(r[parts - 1].end, n);
        assert!(r.windows(2).all(|w| w[0].end == w[1].start) && r.iter().all(|x| !x.is_empty()));
        let max = r
            .iter()
            .map(|x| costs[x.clone()].iter().sum::<f64>())
            .fold(0.0, f64::max);
        assert_eq!(max, brute_force(&costs, parts), "{costs:?} into {parts}");
    }
    assert!(balance_by_cost(&[1.0], 2).is_err());
}

#[test]
fn split_by_params_and_time() {
    let dev = Device::Cpu;
    let (layers, _) = common::mlp(6, 1, &dev);
    let r = balance_by_params(&layers, 3).unwrap();
    assert_eq!(r, vec![0..2, 2..4, 4..6]);
    let x = Tensor::ones((4, common::DIM), candle_core::DType::F32, &dev).unwrap();
    let t = measure_layer_times(&layers, &x, 2).unwrap();
    assert_eq!(t.len(), 6);
    assert!(t.iter().all(|t| *t > 0.0));
    let stages = split_layers(layers.clone(), &r).unwrap();
    assert_eq!(
        stages.iter().map(|s| s.vars().len()).collect::<Vec<_>>(),
        vec![4, 4, 4]
    );
    assert!(split_layers(layers, &[0..2, 3..6]).is_err());
}
