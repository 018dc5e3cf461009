//! MasterWeights registration.

mod common;

use candle_amp::{AmpError, MasterWeights, WeightMode};
use candle_core::{DType, Device, Var};
use candle_nn::VarMap;
use common::seeded_var;
use test_support::compare::values;

#[test]
fn from_varmap_is_sorted_and_shares_vars() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let vm = VarMap::new();
    {
        let mut d = vm.data().lock().expect("lock");
        for (i, n) in ["z.w", "a.b", "m.w", "a.a"].iter().enumerate() {
            d.insert(n.to_string(), seeded_var(i as u64, &[2, 3], &dev));
        }
    }
    let mw = MasterWeights::from_varmap(&vm, DType::BF16, WeightMode::Copies)?;
    assert_eq!(mw.names().collect::<Vec<_>>(), ["a.a", "a.b", "m.w", "z.w"]);
    // The masters are the VarMap's own variables (shared storage).
    let m = mw.master("m.w").expect("m.w");
    m.set(&m.as_tensor().affine(2.0, 0.0)?)?;
    let in_map = vm.data().lock().expect("lock")["m.w"].clone();
    assert_eq!(values(in_map.as_tensor()), values(m.as_tensor()));
    // The compute copy is a separate bf16 variable, refreshed on demand.
    let c = mw.compute_var("m.w").expect("copy");
    assert_eq!(c.dtype(), DType::BF16);
    assert_ne!(
        values(c.as_tensor()),
        values(&m.as_tensor().to_dtype(DType::BF16)?)
    );
    mw.refresh()?;
    assert_eq!(
        values(c.as_tensor()),
        values(&m.as_tensor().to_dtype(DType::BF16)?)
    );
    // compute_varmap hands out the compute copies under the same names.
    let cm = mw.compute_varmap()?;
    let shared = cm.data().lock().expect("lock")["m.w"].clone();
    assert_eq!(shared.as_tensor().id(), c.as_tensor().id());
    Ok(())
}

#[test]
fn bad_registrations_are_rejected() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let a = seeded_var(1, &[2], &dev);
    let dup = MasterWeights::new(
        [("a".to_string(), a.clone()), ("a".to_string(), a.clone())],
        DType::F16,
        WeightMode::Cast,
    );
    assert!(matches!(dup, Err(AmpError::Param { .. })));
    let half = Var::from_tensor(&a.as_tensor().to_dtype(DType::F16)?)?;
    let r = MasterWeights::new([("h".to_string(), half)], DType::F16, WeightMode::Cast);
    assert!(matches!(r, Err(AmpError::Param { .. })));
    let r = MasterWeights::new([("a".to_string(), a)], DType::U32, WeightMode::Cast);
    assert!(matches!(r, Err(AmpError::Config(_))));
    Ok(())
}
