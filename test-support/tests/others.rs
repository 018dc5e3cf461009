//! Seeded data, finite differences and temporary directories.

use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::{DType, Device, Tensor};
use test_support::compare::values;
use test_support::fs::TempDir;
use test_support::grad::{check_fd, value_and_grads};
use test_support::random::{normal, rng, uniform};

#[test]
fn random_tensors_are_seeded_and_in_range() {
    let dev = Device::Cpu;
    let a = values(&uniform(&mut rng(1), &[1000], -2.0, 3.0, &dev));
    assert_eq!(a, values(&uniform(&mut rng(1), &[1000], -2.0, 3.0, &dev)));
    assert_ne!(a, values(&uniform(&mut rng(2), &[1000], -2.0, 3.0, &dev)));
    assert!(a.iter().all(|x| (-2.0..3.0).contains(x)));
    let mean = a.iter().sum::<f64>() / 1000.0;
    assert!((mean - 0.5).abs() < 0.15, "uniform mean {mean}");
    let n = normal(&mut rng(3), &[4000], 2.0, DType::F64, &dev);
    let v = values(&n);
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
    // Standard errors: 2 / sqrt(4000) = 0.03 for the mean, about 2.2% for the variance.
    assert!(mean.abs() < 0.15, "normal mean {mean}");
    assert!((var.sqrt() - 2.0).abs() < 0.1, "normal std {}", var.sqrt());
    assert_eq!(
        normal(&mut rng(3), &[2], 1.0, DType::BF16, &dev).dtype(),
        DType::BF16
    );
}

#[test]
fn finite_differences_accept_the_backward_and_catch_a_wrong_gradient() {
    let dev = Device::Cpu;
    let x = normal(&mut rng(5), &[3, 4], 1.0, DType::F64, &dev);
    let w = normal(&mut rng(6), &[4, 2], 1.0, DType::F64, &dev);
    let probe = normal(&mut rng(7), &[3, 2], 1.0, DType::F64, &dev);
    let f = |ins: &[Tensor]| ins[0].matmul(&ins[1])?.tanh();
    check_fd(&f, &[x.clone(), w.clone()], &probe, 1e-5, 1e-7).unwrap();
    let (y, g) = value_and_grads(&f, &[x.clone(), w.clone()], &probe).unwrap();
    assert_eq!((y.dims(), g.len()), (&[3, 2][..], 2));
    // An op whose backward is wrong: forward x^2 + x, backward of x^2 only.
    let wrong = |ins: &[Tensor]| (ins[0].sqr()? + ins[0].detach())?.sum_keepdim(1);
    let r = catch_unwind(AssertUnwindSafe(|| {
        check_fd(
            &wrong,
            std::slice::from_ref(&x),
            &probe.narrow(1, 0, 1).unwrap(),
            1e-5,
            1e-7,
        )
    }));
    assert!(r.is_err(), "a wrong gradient passed");
}

#[test]
fn temp_dirs_are_fresh_and_removed() {
    let a = TempDir::new("test-support");
    let b = TempDir::new("test-support");
    assert_ne!(a.path(), b.path());
    std::fs::write(a.join("f"), b"x").unwrap();
    let p = a.path().to_path_buf();
    drop(a);
    assert!(!p.exists());
    assert!(b.path().is_dir());
}
