//! `check_launch` on the RoPE launch table.

use super::*;

#[test]
fn check_launch_rope_layouts_and_tables() -> Result<()> {
    use Arg::{Null, Tensor as T, I32};
    let (b, tt, h, d) = (2usize, 7usize, 3usize, 10usize);
    let tab = |tb: usize, half: usize| t(&[tb, tt, half], DType::F32);
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let (bthd, bhtd) = (t(&[b, tt, h, d], dt), t(&[b, h, tt, d], dt));
        let layouts = [
            (
                "rope_fwd",
                &bthd,
                &bhtd,
                "Y has H = 7, an earlier argument 3",
            ),
            (
                "rope_bwd",
                &bhtd,
                &bthd,
                "DX has T = 3, an earlier argument 7",
            ),
        ];
        for (name, src, dst, transposed) in layouts {
            let k = find(name, dt).unwrap();
            // tables per batch row (TB = B) and shared by the batch (TB = 1)
            for tb in [b, 1] {
                let args = [src.clone(), tab(tb, 5), tab(tb, 5), dst.clone()];
                let l = check_launch(k, &args, &[])?;
                assert_eq!((l.grid, l.block), ([14, 1, 1], [128, 1, 1]));
                let tb = tb as i32;
                let want = [
                    T(0),
                    T(1),
                    T(2),
                    T(3),
                    I32(7),
                    I32(3),
                    I32(5),
                    I32(tb),
                    Null,
                    Null,
                ];
                assert_eq!(l.args, want);
            }
            // the output's layout is the transpose of the input's: T != H tells them apart
            let e = check_launch(k, &[src.clone(), tab(b, 5), tab(b, 5), src.clone()], &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains(transposed), "{e}");
        }
    }
    let dt = DType::BF16;
    let fwd = find("rope_fwd", dt).unwrap();
    // any even head dim, no tile limit: D = 600 (300 pairs) is one program per position
    let l = check_launch(
        fwd,
        &[
            t(&[1, tt, 1, 600], dt),
            tab(1, 300),
            tab(1, 300),
            t(&[1, 1, tt, 600], dt),
        ],
        &[],
    )?;
    assert_eq!(l.grid, [7, 1, 1]);
    // an odd head dim has no halves
    let x = t(&[b, tt, h, 9], dt);
    let y = t(&[b, h, tt, 9], dt);
    refuses(
        fwd,
        &[x, tab(b, 4), tab(b, 4), y],
        &[],
        "D must be 2 * HALF = 8, got 9",
    );
    // tables of another batch size, or not f32
    let (x, y) = (t(&[b, tt, h, d], dt), t(&[b, h, tt, d], dt));
    refuses(
        fwd,
        &[x.clone(), tab(3, 5), tab(3, 5), y.clone()],
        &[],
        "TB = 3 must divide B = 2",
    );
    let bf = t(&[b, tt, 5], dt);
    refuses(
        fwd,
        &[x.clone(), bf.clone(), bf, y.clone()],
        &[],
        "COS must be F32",
    );
    // a strided x (a head slice of a packed qkv) must be made contiguous first
    let mut xs = x.clone();
    xs.strides = vec![tt * 3 * h * d, 3 * h * d, d, 1];
    refuses(
        fwd,
        &[xs, tab(b, 5), tab(b, 5), y],
        &[],
        "X must be contiguous",
    );
    Ok(())
}
