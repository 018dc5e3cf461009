//! `check_launch` on the RMSNorm, and the generic rules of `check_launch` launch table.

use super::*;

#[test]
fn check_launch_accepts_the_contract_and_rejects_the_rest() -> Result<()> {
    let (n, c) = (37usize, 129usize);
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let fwd = find("rms_norm_fwd", dt).unwrap();
        let l = check_launch(
            fwd,
            &[
                t(&[n, c], dt),
                t(&[c], dt),
                t(&[n, c], dt),
                t(&[n], DType::F32),
            ],
            EPS,
        )?;
        assert_eq!(l.grid, [37, 1, 1]);
        assert_eq!(l.block, [256, 1, 1]);
        use Arg::{F32, I32};
        assert_eq!(l.args, args_of(4, &[I32(37), I32(129), F32(1e-5)]));
        assert_eq!(
            (l.dim("N"), l.dim("C"), l.dim("P")),
            (Some(37), Some(129), None)
        );
        assert_eq!(l.shared_bytes, fwd.shared_bytes);

        let p = n.div_ceil(rms_norm::ROWS_PER_PROGRAM);
        let dx = find("rms_norm_bwd_dx", dt).unwrap();
        let (x, w, rstd, part) = (
            t(&[n, c], dt),
            t(&[c], dt),
            t(&[n], DType::F32),
            t(&[p, c], DType::F32),
        );
        let args = [&x, &w, &x, &rstd, &x, &part].map(Clone::clone);
        let l = check_launch(dx, &args, &[])?;
        assert_eq!(l.grid, [2, 1, 1]);
        assert_eq!(l.args, args_of(6, &[I32(37), I32(129)]));
        let mut wrong_p = args.clone();
        wrong_p[5] = t(&[p + 1, c], DType::F32);
        refuses(dx, &wrong_p, &[], "cdiv(N, 32)");

        let dw = find("rms_norm_bwd_dw", dt).unwrap();
        let l = check_launch(dw, &[part, w], &[])?;
        assert_eq!(
            (l.grid, l.block, l.args),
            ([1, 1, 1], [64, 1, 1], args_of(2, &[I32(2), I32(129)]))
        );
    }
    let dt = DType::BF16;
    let fwd = find("rms_norm_fwd", dt).unwrap();
    let (x, w, rstd) = (t(&[n, c], dt), t(&[c], dt), t(&[n], DType::F32));
    let ok = [&x, &w, &x, &rstd].map(Clone::clone);
    // misaligned: a view starting one row into a buffer (129 bf16 = 258 bytes)
    let mut a = ok.clone();
    a[0].offset_bytes = c * 2;
    let e = check_launch(fwd, &a, EPS).unwrap_err().to_string();
    assert!(
        e.contains("byte offset 258") && e.contains("16-byte aligned"),
        "{e}"
    );
    // an aligned offset is fine
    a[0].offset_bytes = 256;
    check_launch(fwd, &a, EPS)?;
    // strided rows
    let mut a = ok.clone();
    a[2].strides = vec![2 * c, 1];
    refuses(fwd, &a, EPS, "Y must be contiguous");
    // wrong dtypes
    let mut a = ok.clone();
    a[3] = t(&[n], DType::BF16);
    refuses(fwd, &a, EPS, "RSTD must be F32");
    // mismatched shapes
    let mut a = ok.clone();
    a[1] = t(&[c + 1], dt);
    refuses(fwd, &a, EPS, "W has C = 130");
    // rows longer than one tile
    let big = 4097;
    let a = [
        t(&[2, big], dt),
        t(&[big], dt),
        t(&[2, big], dt),
        t(&[2], DType::F32),
    ];
    refuses(fwd, &a, EPS, "C = 4097 exceeds 4096");
    // scalars: missing, of the wrong kind, or too many
    refuses(fwd, &ok, &[], "eps needs a Scalar::F32");
    refuses(fwd, &ok, &[Scalar::I32(1)], "eps needs a Scalar::F32");
    refuses(fwd, &ok, &[EPS[0], EPS[0]], "left over");
    // wrong number of arguments, empty grid
    assert!(check_launch(fwd, &ok[..3], EPS).is_err());
    let a = [
        t(&[0, c], dt),
        t(&[c], dt),
        t(&[0, c], dt),
        t(&[0], DType::F32),
    ];
    assert!(check_launch(fwd, &a, EPS).is_err());
    // every table entry has a distinct name and a known dtype
    for k in kernels() {
        assert_ne!(dtype_suffix(k.dtype), "?");
        assert_eq!(kernels().filter(|o| o.name() == k.name()).count(), 1);
    }
    Ok(())
}
