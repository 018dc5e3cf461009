//! Whether a model fits in the memory this process may use, told from its config alone
//! before anything of its size is allocated.

use crate::model::ModelConfig;
use crate::{Error, Result};

/// Bytes every layer costs the host besides its tensors' data (its parameters' names, shapes,
/// variables and storage headers, its entries in plans and cost tables): counted so that the
/// layer count alone is bounded by memory.
const LAYER_OVERHEAD: u64 = 4 << 10;

/// The memory this process may still allocate (available RAM, or the cgroup's limit minus its
/// anonymous memory in a container, whichever is smaller), or `None` when it cannot be told.
///
/// Not the cgroup's limit minus its usage (sysinfo's `free_memory`): that usage counts the page
/// cache, which the kernel reclaims on demand, so a machine whose cache had filled its RAM
/// (after copying a build directory, say) refused runs that fit many times over.
pub(crate) fn available_memory() -> Option<u64> {
    use sysinfo::{MemoryRefreshKind, RefreshKind, System};
    let sys = System::new_with_specifics(
        RefreshKind::nothing().with_memory(MemoryRefreshKind::nothing().with_ram()),
    );
    let mut available = sys.available_memory();
    if let Some(cg) = sys.cgroup_limits() {
        available = available.min(cg.total_memory.saturating_sub(cg.rss));
    }
    (available > 0).then_some(available)
}

/// Errors, naming `what` needs the memory and what to change, when `need` bytes exceed
/// `available_memory` (nothing is checked when it cannot be told).
pub fn check_fits(need: u64, what: &str, advice: &str) -> Result<()> {
    match available_memory() {
        Some(available) if need > available => {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            Err(Error::Config(format!(
                "{what} needs at least an estimated {:.1} GiB but only {:.1} GiB of memory is \
                 available: {advice}",
                gib(need),
                gib(available)
            )))
        }
        _ => Ok(()),
    }
}

/// What a model's f32 weights need at the least, in O(1) (a training step's floor adds the
/// logits, gradients and optimiser state): checked before its parameter list is built, by the
/// commands that only read a model.
pub(crate) fn weights_floor(model: &dyn ModelConfig) -> u64 {
    sized_floor(model, 4)
}

/// Each layer's overhead and norms, and the token embedding, at `per_param` bytes a
/// parameter.
pub fn sized_floor(model: &dyn ModelConfig, per_param: u64) -> u64 {
    let shape = model.shape();
    let (layers, width) = (shape.n_layer as u64, shape.n_embd as u64);
    let layer = width
        .saturating_mul(2 * per_param)
        .saturating_add(LAYER_OVERHEAD);
    layers.saturating_mul(layer).saturating_add(
        (model.vocab_size() as u64)
            .saturating_mul(width)
            .saturating_mul(per_param),
    )
}
