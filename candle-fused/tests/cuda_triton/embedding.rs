//! The embedding backward's case (`triton/embedding.py`): `dW` bit-identical to the CPU
//! kernel, every dtype (the same f32 adds in the same order, each row rounded once). The ids'
//! order comes from the host copy of the ids, as the trainer passes it (no read-back). The
//! composite fallback (Candle's `index_add` into an f32 zero table, one thread per column
//! adding the ids in position order) gives the same bits: no `FALLBACK` entry.

use super::{grad, input, Case, Check, Mode, Outputs};
use anyhow::Result;
use candle_core::{Device, Tensor, Var};
use candle_fused::embedding::embedding;
use std::collections::HashMap;

pub(super) fn cases() -> Vec<Case> {
    vec![Case {
        name: "embedding",
        family: "embedding",
        checks: EMBEDDING,
        run: run_embedding,
        // the backward (the forward is Candle's index_select)
        launches: |_| Ok(1),
        cpu_composite: [1.0; 3],
    }]
}

const EMBEDDING: &[Check] = &[Check {
    name: "dw",
    mode: Mode::Row,
    tol: [0.0; 3],
}];

fn run_embedding(dev: &Device, t: &HashMap<String, Tensor>) -> Result<Outputs> {
    let w = Var::from_tensor(&input(t, "w", dev)?)?;
    let host = input(t, "ids", &Device::Cpu)?.to_vec1::<u32>()?;
    let ids = input(t, "ids", dev)?;
    let dy = input(t, "dy", dev)?;
    let y = embedding(w.as_tensor(), &ids, Some(&host))?;
    let g = (&y * &dy)?.sum_all()?.backward()?;
    Ok(vec![("dw", grad(&g, &w)?)])
}
