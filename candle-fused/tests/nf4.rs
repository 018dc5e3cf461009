//! `nf4`: bit-compatibility with bitsandbytes 0.50.2 on the fixtures of
//! `scripts/python/make_nf4_fixtures.py` (`tests/fixtures/nf4/nf4.safetensors`): for every case,
//! plain and double-quantized (random blocks, exact midpoints between NF4 values and their
//! neighbours one ulp away, a block holding an outlier, an all-zero block, a negative absmax,
//! a last block shorter than 64), quantizing the input gives the same packed codes, absmaxes,
//! nested codes, nested absmaxes, offset, map and quant-state JSON; dequantizing gives the same
//! f32, bf16 and f16 values; the tensors transformers saves read back equal and dequantize
//! equal, on the host and through Candle ops. Every comparison is exact (bits).
//! Errors: another quantization type, a quant map that is not NF4's, state that does not fit.

use std::collections::HashMap;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_fused::nf4::{dynamic_map, Absmax, Nf4Weight, NF4_VALUES, QUANT_STATE_SUFFIX};
use candle_fused::with_composite_fallback;

const CASES: [&str; 6] = [
    "random",
    "edges",
    "tail",
    "random_dq",
    "edges_dq",
    "tail_dq",
];

fn fixtures() -> Result<HashMap<String, Tensor>> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/nf4/nf4.safetensors"
    );
    Ok(candle_core::safetensors::load(path, &Device::Cpu)?)
}

/// The raw bytes of `t` (f32/bf16/f16 bits or u8), for exact comparison.
fn bits(t: &Tensor) -> Result<Vec<u64>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::U8 => t.to_vec1::<u8>()?.into_iter().map(u64::from).collect(),
        DType::F32 => t
            .to_vec1::<f32>()?
            .into_iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .into_iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()?
            .into_iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        d => anyhow::bail!("unexpected dtype {d:?}"),
    })
}

fn assert_same(what: &str, ours: &Tensor, theirs: &Tensor) -> Result<()> {
    let (a, b) = (bits(ours)?, bits(theirs)?);
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
        panic!(
            "{what}: first difference at {i}: ours {:#x}, bitsandbytes {:#x}",
            a[i], b[i]
        );
    }
    Ok(())
}

fn get<'a>(fx: &'a HashMap<String, Tensor>, name: &str) -> &'a Tensor {
    fx.get(name)
        .unwrap_or_else(|| panic!("fixture tensor {name} missing"))
}

fn check_dequant(fx: &HashMap<String, Tensor>, case: &str, q: &Nf4Weight) -> Result<()> {
    for (dtype, tag) in [
        (DType::F32, "f32"),
        (DType::BF16, "bf16"),
        (DType::F16, "f16"),
    ] {
        let want = get(fx, &format!("{case}.dequant_{tag}"));
        assert_same(
            &format!("{case} dequant {tag}"),
            &q.dequantize(dtype)?,
            want,
        )?;
        let composite = with_composite_fallback(|| q.dequantize(dtype))?;
        assert_same(
            &format!("{case} dequant {tag} (Candle ops)"),
            &composite,
            want,
        )?;
    }
    Ok(())
}

#[test]
fn quantize_matches_bitsandbytes() -> Result<()> {
    let fx = fixtures()?;
    for case in CASES {
        let double = case.ends_with("_dq");
        let input = get(&fx, &format!("{case}.input"));
        let q = Nf4Weight::quantize(input, double)?;
        if let Absmax::Nested(n) = q.absmax() {
            let off = get(&fx, &format!("{case}.nested_offset")).to_vec1::<f32>()?[0];
            assert_eq!(n.offset.to_bits(), off.to_bits(), "{case}: nested offset");
        }
        let saved = q.to_tensors(&format!("{case}.weight"))?;
        for (name, ours) in &saved {
            assert_same(name, ours, get(&fx, name))?;
            assert_eq!(ours.dims(), get(&fx, name).dims(), "{name}: shape");
        }
        // Exactly the tensors transformers saves.
        let mut theirs: Vec<&String> = fx
            .keys()
            .filter(|k| k.starts_with(&format!("{case}.weight")))
            .collect();
        theirs.sort();
        assert_eq!(
            saved.keys().collect::<Vec<_>>(),
            theirs,
            "{case}: tensor names"
        );
        check_dequant(&fx, case, &q)?;
    }
    Ok(())
}

#[test]
fn saved_tensors_read_back_equal() -> Result<()> {
    let fx = fixtures()?;
    for case in CASES {
        let prefix = format!("{case}.weight");
        let q = Nf4Weight::from_tensors(&prefix, &|n| Ok(fx.get(n).cloned()))?;
        assert_eq!(q.shape(), get(&fx, &format!("{case}.input")).dims());
        assert_eq!(q.dtype(), DType::F32);
        for (name, ours) in q.to_tensors(&prefix)? {
            assert_same(&name, &ours, get(&fx, &name))?;
        }
        check_dequant(&fx, case, &q)?;
    }
    Ok(())
}

#[test]
fn tables_and_edge_blocks() -> Result<()> {
    let fx = fixtures()?;
    let map = get(&fx, "random_dq.weight.nested_quant_map").to_vec1::<f32>()?;
    assert_eq!(map, dynamic_map().to_vec());
    assert_eq!(
        get(&fx, "random.weight.quant_map").to_vec1::<f32>()?,
        NF4_VALUES.to_vec()
    );
    // edges: block 3 is all zero (absmax 0, every code the zero value's, 7); block 0 holds
    // the midpoints at absmax 1 (each takes the lower code: i for midpoint i).
    let q = Nf4Weight::quantize(get(&fx, "edges.input"), false)?;
    let Absmax::Plain(a) = q.absmax() else {
        panic!("plain absmax expected")
    };
    assert_eq!(a.to_vec1::<f32>()?[3], 0.0);
    let packed = q.packed().to_vec1::<u8>()?;
    assert!(packed[3 * 32..4 * 32].iter().all(|&b| b == 0x77));
    let codes: Vec<u8> = packed[..8].iter().flat_map(|b| [b >> 4, b & 15]).collect();
    assert_eq!(codes[..15], (0..15).collect::<Vec<u8>>()[..]);
    Ok(())
}

#[test]
fn refuses_what_does_not_fit() -> Result<()> {
    let fx = fixtures()?;
    let prefix = "random_dq.weight";
    let with = |name: &'static str, t: Tensor| {
        let fx = fx.clone();
        move |n: &str| -> candle_core::Result<Option<Tensor>> {
            Ok(if n == format!("{prefix}.{name}") {
                Some(t.clone())
            } else {
                fx.get(n).cloned()
            })
        }
    };
    let err = |f: &dyn Fn(&str) -> candle_core::Result<Option<Tensor>>| {
        Nf4Weight::from_tensors(prefix, f).unwrap_err().to_string()
    };
    // Another quantization type, by name.
    let fp4 = |n: &str| -> candle_core::Result<Option<Tensor>> {
        let state = format!("{prefix}.{QUANT_STATE_SUFFIX}");
        Ok(match n {
            _ if n == state => None,
            _ if n == format!("{prefix}.quant_state.bitsandbytes__fp4") => fx.get(&state).cloned(),
            _ => fx.get(n).cloned(),
        })
    };
    let e = err(&fp4);
    assert!(e.contains("bitsandbytes__fp4") && e.contains("fp4"), "{e}");
    // A quant state that says fp4.
    let json = br#"{"quant_type": "fp4", "blocksize": 64, "dtype": "float32", "shape": [75, 256]}"#;
    let state = Tensor::new(&json[..], &Device::Cpu)?;
    let e = err(&with("quant_state.bitsandbytes__nf4", state));
    assert!(e.contains("quant_type") && e.contains("fp4"), "{e}");
    // Absmaxes that do not fit the weight, named.
    let short = get(&fx, "random_dq.weight.absmax").narrow(0, 0, 10)?;
    let e = err(&with("absmax", short));
    assert!(
        e.contains("`random_dq.weight.absmax` holds 10 values"),
        "{e}"
    );
    let short = get(&fx, "random_dq.weight.nested_absmax").narrow(0, 0, 1)?;
    let e = err(&with("nested_absmax", short));
    assert!(
        e.contains("`random_dq.weight.nested_absmax` holds 1 values"),
        "{e}"
    );
    // A shape the packed codes do not hold.
    let json = br#"{"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [76, 256], "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.05}"#;
    let state = Tensor::new(&json[..], &Device::Cpu)?;
    let e = err(&with("quant_state.bitsandbytes__nf4", state));
    assert!(e.contains("`random_dq.weight` holds 9600 values"), "{e}");
    // A quant map that is not NF4's.
    let e = err(&with(
        "quant_map",
        Tensor::zeros(16, DType::F32, &Device::Cpu)?,
    ));
    assert!(e.contains("random_dq.weight.quant_map"), "{e}");
    // A missing part.
    let missing = |n: &str| -> candle_core::Result<Option<Tensor>> {
        Ok(match n.ends_with("nested_quant_map") {
            true => None,
            false => fx.get(n).cloned(),
        })
    };
    let e = err(&missing);
    assert!(
        e.contains("`random_dq.weight.nested_quant_map` is missing"),
        "{e}"
    );
    Ok(())
}

#[test]
fn double_quantization_of_many_absmaxes() -> Result<()> {
    // Block i = [a_i, 0, ..., 0]: absmax a_i; the offset is torch's f32 mean of the a_i, whose
    // summation order this reproduces (scalar below 8 values, 8-lane vectors, cascaded levels).
    let fx = fixtures()?;
    let mut sizes: Vec<usize> = fx
        .keys()
        .filter_map(|k| {
            k.strip_prefix("mean_")?
                .strip_suffix(".offset")?
                .parse()
                .ok()
        })
        .collect();
    sizes.sort();
    assert_eq!(sizes, [1, 3, 5, 6, 7, 8, 9, 31, 33, 100, 257, 1000, 5000]);
    for n in sizes {
        let a = get(&fx, &format!("mean_{n}.absmax"));
        let first = a.reshape((n, 1))?;
        let w = Tensor::cat(
            &[&first, &Tensor::zeros((n, 63), DType::F32, &Device::Cpu)?],
            1,
        )?;
        let q = Nf4Weight::quantize(&w, true)?;
        let Absmax::Nested(nested) = q.absmax() else {
            panic!("nested absmax expected")
        };
        let want = get(&fx, &format!("mean_{n}.offset")).to_vec1::<f32>()?[0];
        assert_eq!(nested.offset.to_bits(), want.to_bits(), "{n} absmaxes");
        // The 8-bit codes through bitsandbytes' lookup table (some values lie within half a
        // table step of a midpoint: the nearest code would differ there).
        assert_same(
            &format!("mean_{n} codes"),
            &nested.codes,
            get(&fx, &format!("mean_{n}.codes")),
        )?;
        let want = get(&fx, &format!("mean_{n}.nested_absmax"));
        assert_same(&format!("mean_{n} nested absmax"), &nested.absmax, want)?;
    }
    Ok(())
}

#[test]
fn quantization_is_deterministic() -> Result<()> {
    let w = Tensor::randn(0f32, 0.02, (96, 256), &Device::Cpu)?;
    let a = Nf4Weight::quantize(&w, true)?.to_tensors("w")?;
    let b = Nf4Weight::quantize(&w, true)?.to_tensors("w")?;
    for (k, t) in &a {
        assert_same(k, t, &b[k])?;
    }
    Ok(())
}

/// The host dequantization (straight into the compute type, split over the threads) equals
/// the Candle-ops one bit for bit: ranges starting and ending on odd values and inside blocks,
/// a range long enough to be split, every compute dtype, quant states in f32, bf16 and f16
/// (rounded to the state's dtype first), plain and double-quantized, on 1 and 2 threads.
#[test]
fn host_ranges_match_candle_ops() -> Result<()> {
    let (rows, cols) = (301, 257);
    let n = rows * cols;
    let ranges = [
        (0, n),
        (1, n - 1),
        (63, 65),
        (65, 66),
        (3, 3),
        (129, 40_001),
    ];
    let w = Tensor::randn(0f32, 0.05, (rows, cols), &Device::Cpu)?;
    for (state, double) in [(DType::F32, true), (DType::BF16, false), (DType::F16, true)] {
        let q = Nf4Weight::quantize(&w.to_dtype(state)?, double)?;
        let absmax = q.absmax_f32()?;
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()?;
            for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
                for (a, b) in ranges {
                    let what = format!("state {state:?} {dtype:?} {a}..{b} on {threads}");
                    let host = pool.install(|| q.dequantize_range(&absmax, a, b, dtype))?;
                    let ops = with_composite_fallback(|| q.dequantize_range(&absmax, a, b, dtype))?;
                    assert_eq!(host.dtype(), dtype, "{what}");
                    let wide = |t: &Tensor| -> Result<Vec<u64>> {
                        let v = t.to_dtype(DType::F64)?.to_vec1::<f64>()?;
                        Ok(v.into_iter().map(f64::to_bits).collect())
                    };
                    assert_eq!(wide(&host)?, wide(&ops)?, "{what}");
                }
            }
        }
    }
    Ok(())
}
