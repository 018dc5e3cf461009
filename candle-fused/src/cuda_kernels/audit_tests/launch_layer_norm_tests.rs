//! `check_launch` on the LayerNorm launch table.

use super::*;

#[test]
fn check_launch_layer_norm_with_and_without_bias() -> Result<()> {
    use Arg::{Null, Tensor as T, F32, I32};
    let (n, c) = (70usize, 300usize);
    let p = n.div_ceil(layer_norm::ROWS_PER_PROGRAM);
    assert_eq!(p, 3);
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let (x, w, stat) = (t(&[n, c], dt), t(&[c], dt), t(&[n], DType::F32));
        let part = t(&[p, c], DType::F32);
        let fwd = find("layer_norm_fwd", dt).unwrap();
        let args = [&x, &w, &w, &x, &stat, &stat].map(Clone::clone);
        let l = check_launch(fwd, &args, EPS)?;
        assert_eq!((l.grid, l.block), ([70, 1, 1], [256, 1, 1]));
        let mut want = (0..6).map(T).collect::<Vec<_>>();
        want.extend([I32(70), I32(300), F32(1e-5), Null, Null]);
        assert_eq!(l.args, want);
        // the bias variant needs the bias: five tensors are the no-bias entry's arguments
        refuses(
            fwd,
            &args[1..],
            EPS,
            "expected 6 tensor arguments (X, W, B, Y",
        );
        let nb = find("layer_norm_fwd_no_bias", dt).unwrap();
        let l = check_launch(
            nb,
            &[x.clone(), w.clone(), x.clone(), stat.clone(), stat.clone()],
            EPS,
        )?;
        assert_eq!(l.args[..6], [T(0), T(1), T(2), T(3), T(4), I32(70)]);

        let dx = find("layer_norm_bwd_dx", dt).unwrap();
        let args = [&x, &w, &x, &stat, &stat, &x, &part, &part].map(Clone::clone);
        let l = check_launch(dx, &args, &[])?;
        assert_eq!((l.grid, l.block), ([3, 1, 1], [256, 1, 1]));
        let mut want = (0..8).map(T).collect::<Vec<_>>();
        want.extend([I32(70), I32(300), Null, Null]);
        assert_eq!(l.args, want);
        let mut wrong = args.clone();
        wrong[7] = t(&[p - 1, c], DType::F32);
        refuses(dx, &wrong, &[], "DB_PARTIAL has P = 2");
        let nb = find("layer_norm_bwd_dx_no_bias", dt).unwrap();
        let l = check_launch(nb, &args[..7], &[])?;
        assert_eq!(l.grid, [3, 1, 1]);
        refuses(nb, &args, &[], "expected 7 tensor arguments");

        // the reduction: 300 columns are two programs of 256
        let red = find("layer_norm_bwd_reduce", dt).unwrap();
        let l = check_launch(red, &[part.clone(), w.clone()], &[])?;
        assert_eq!((l.grid, l.block), ([2, 1, 1], [64, 1, 1]));
        assert_eq!(l.args, [T(0), T(1), I32(3), I32(300), Null, Null]);
        let e = check_launch(red, &[part.clone(), t(&[c], DType::F32)], &[]);
        assert_eq!(e.is_err(), dt != DType::F32);
    }
    let dt = DType::F16;
    let fwd = find("layer_norm_fwd_no_bias", dt).unwrap();
    let (x, w, stat) = (t(&[n, c], dt), t(&[c], dt), t(&[n], DType::F32));
    let mut a = [x.clone(), w.clone(), x.clone(), stat.clone(), stat.clone()];
    a[3] = t(&[n], dt);
    refuses(fwd, &a, EPS, "MEAN must be F32");
    let big = layer_norm::BLOCK_C + 1;
    let a = [
        t(&[2, big], dt),
        t(&[big], dt),
        t(&[2, big], dt),
        t(&[2], DType::F32),
        t(&[2], DType::F32),
    ];
    refuses(fwd, &a, EPS, "C = 4097 exceeds 4096");
    Ok(())
}
