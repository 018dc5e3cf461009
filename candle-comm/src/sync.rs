//! Keeping parameters identical across ranks: broadcast them once, check them cheaply.

use candle_core::{DType, Var};
use candle_nn::VarMap;

use crate::comm::Communicator;
use crate::error::{CandleContext, CommError, Op, Result};
use crate::host::dtype_code;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn mix(h: u64, word: u64) -> u64 {
    (h ^ word).wrapping_mul(FNV_PRIME)
}

/// The variables of a `VarMap` sorted by name: the same order on every rank (a `VarMap` iterates
/// a `HashMap`, whose order differs between processes).
pub fn sorted_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
    let mut vars: Vec<(String, Var)> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

/// A 64-bit hash (FNV-1a over 32/64-bit words) of the dtypes, shapes and exact bit patterns of
/// `vars`, in order. Equal parameters give equal fingerprints on every rank; any differing bit
/// changes it with overwhelming probability. Copies each tensor to the host once.
pub fn fingerprint(vars: &[Var]) -> candle_core::Result<u64> {
    let mut h = FNV_OFFSET;
    for v in vars {
        let t = v.as_tensor();
        h = mix(h, dtype_code(t.dtype()));
        for &d in t.dims() {
            h = mix(h, d as u64);
        }
        let flat = t.flatten_all()?;
        match t.dtype() {
            DType::F32 | DType::BF16 | DType::F16 => {
                for x in flat.to_dtype(DType::F32)?.to_vec1::<f32>()? {
                    h = mix(h, u64::from(x.to_bits()));
                }
            }
            _ => {
                for x in flat.to_dtype(DType::F64)?.to_vec1::<f64>()? {
                    h = mix(h, x.to_bits());
                }
            }
        }
    }
    Ok(h)
}

/// Every rank's `value`, in rank order (one all-gather of four 16-bit pieces carried exactly in
/// f64).
pub(crate) fn gather_u64<C: Communicator + ?Sized>(
    comm: &C,
    value: u64,
    op: Op,
) -> Result<Vec<u64>> {
    let rank = comm.rank();
    let pieces: Vec<f64> = (0..4)
        .map(|i| ((value >> (16 * i)) & 0xffff) as f64)
        .collect();
    let t = candle_core::Tensor::from_vec(pieces, 4, &candle_core::Device::Cpu).at(rank, op)?;
    let all = comm.all_gather(&t)?.to_vec1::<f64>().at(rank, op)?;
    Ok(all
        .chunks(4)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u64, |acc, (i, &p)| acc | ((p as u64) << (16 * i)))
        })
        .collect())
}

/// Outcome of [`check_in_sync`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncReport {
    /// Each rank's parameter [`fingerprint`], in rank order.
    pub fingerprints: Vec<u64>,
    /// Ranks whose fingerprint differs from rank 0's (empty when in sync).
    pub differing: Vec<usize>,
}

impl SyncReport {
    /// Whether every rank holds bit-identical parameters.
    pub fn in_sync(&self) -> bool {
        self.differing.is_empty()
    }
}

/// Compares the parameters of every rank: one [`fingerprint`] per rank and one all-gather of
/// 32 bytes per rank. Call it every few hundred steps (it copies the parameters to the host).
/// Every rank must pass its copies of the same variables, in the same order.
pub fn check_in_sync<C: Communicator + ?Sized>(comm: &C, vars: &[Var]) -> Result<SyncReport> {
    let mine = fingerprint(vars).at(comm.rank(), Op::SyncCheck)?;
    let fingerprints = gather_u64(comm, mine, Op::SyncCheck)?;
    let differing = (0..fingerprints.len())
        .filter(|&r| fingerprints[r] != fingerprints[0])
        .collect();
    Ok(SyncReport {
        fingerprints,
        differing,
    })
}

/// [`check_in_sync`], returning [`CommError::WeightDrift`] (on every rank) when parameters
/// differ.
pub fn ensure_in_sync<C: Communicator + ?Sized>(comm: &C, vars: &[Var]) -> Result<()> {
    let report = check_in_sync(comm, vars)?;
    if report.in_sync() {
        return Ok(());
    }
    Err(CommError::WeightDrift {
        rank: comm.rank(),
        op: Op::SyncCheck,
        differing: report.differing,
    })
}

/// Overwrites every rank's `vars` with rank `root`'s values (one broadcast per variable), e.g.
/// right after initialisation so that data-parallel ranks start from identical weights.
pub fn broadcast_vars<C: Communicator + ?Sized>(comm: &C, vars: &[Var], root: usize) -> Result<()> {
    for v in vars {
        let t = comm.broadcast(v.as_tensor(), root)?;
        if comm.rank() != root {
            v.set(&t).at(comm.rank(), Op::Broadcast)?;
        }
    }
    Ok(())
}
