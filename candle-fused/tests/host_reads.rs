//! The cross-entropy ops read their targets back to the host once (counted by
//! `candle_fused::host::read_count`) unless the caller passes their host copy, and then read
//! nothing; the results are the same bits either way, and a host copy of the wrong length is
//! refused naming the op. One test in its own binary: the count is process-wide.

use candle_core::{Device, Result, Tensor};
use candle_fused::cross_entropy::{cross_entropy, cross_entropy_composite};
use candle_fused::host::{read_count, Targets};
use candle_fused::linear_cross_entropy::{
    linear_cross_entropy, linear_cross_entropy_composite, linear_cross_entropy_per_token,
    linear_cross_entropy_per_token_composite,
};

type Op = fn(&Tensor, &Tensor, Targets<'_>) -> Result<Tensor>;

#[test]
fn targets_are_read_once_without_their_host_copy_and_never_with_it() {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (2, 3, 4), &dev).unwrap();
    let logits = Tensor::randn(0f32, 1.0, (2, 3, 5), &dev).unwrap();
    let host = [1u32, 9, 4, 0, 9, 2];
    let targets = Tensor::new(&[[1u32, 9, 4], [0, 9, 2]], &dev).unwrap();
    let ops: [(&str, Op); 6] = [
        ("cross_entropy", |_, l, t| {
            cross_entropy(l, t, None, Some(9))
        }),
        ("cross_entropy_composite", |_, l, t| {
            cross_entropy_composite(l, t, None, Some(9))
        }),
        ("linear_cross_entropy", |x, _, t| {
            linear_cross_entropy(x, &w_of(x)?, t, Some(9))
        }),
        ("linear_cross_entropy_composite", |x, _, t| {
            linear_cross_entropy_composite(x, &w_of(x)?, t, Some(9))
        }),
        ("linear_cross_entropy_per_token", |x, _, t| {
            linear_cross_entropy_per_token(x, &w_of(x)?, t, Some(9))
        }),
        ("linear_cross_entropy_per_token_composite", |x, _, t| {
            linear_cross_entropy_per_token_composite(x, &w_of(x)?, t, Some(9))
        }),
    ];
    for (name, op) in ops {
        let before = read_count();
        let with = op(&x, &logits, Targets::new(&targets).with_host(&host)).unwrap();
        assert_eq!(read_count(), before, "{name}: read with the host copy");
        let without = op(&x, &logits, Targets::new(&targets)).unwrap();
        assert_eq!(read_count(), before + 1, "{name}: not read once without it");
        let bits = |t: &Tensor| -> Vec<u32> {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.iter().map(|f| f.to_bits()).collect()
        };
        assert_eq!(bits(&with), bits(&without), "{name}");
        let err = op(&x, &logits, Targets::new(&targets).with_host(&host[..5]))
            .unwrap_err()
            .to_string();
        assert!(err.contains(name) && err.contains("host copy"), "{err}");
    }
}

/// The `[5, 4]` weight the linear ops use.
fn w_of(x: &Tensor) -> Result<Tensor> {
    Tensor::arange(0f32, 20.0, x.device())?
        .affine(0.05, -0.5)?
        .reshape((5, 4))
}
