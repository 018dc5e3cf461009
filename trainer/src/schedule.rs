//! Learning-rate schedule: linear warm-up, then cosine decay to a floor.

use serde::{Deserialize, Serialize};

/// nanoGPT's schedule: `lr * (step + 1) / (warmup_iters + 1)` during warm-up, then a cosine from
/// `lr` down to `min_lr` at `decay_iters`, then `min_lr`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct LrSchedule {
    /// Peak learning rate.
    pub lr: f64,
    /// Floor reached at `decay_iters`.
    pub min_lr: f64,
    /// Steps of linear warm-up.
    pub warmup_iters: usize,
    /// Step at which the decay ends.
    pub decay_iters: usize,
}

impl LrSchedule {
    /// The learning rate of optimiser step `step` (0-based).
    pub fn at(&self, step: usize) -> f64 {
        if step < self.warmup_iters {
            return self.lr * (step + 1) as f64 / (self.warmup_iters + 1) as f64;
        }
        if step >= self.decay_iters {
            return self.min_lr;
        }
        let span = (self.decay_iters - self.warmup_iters).max(1) as f64;
        let ratio = (step - self.warmup_iters) as f64 / span;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        self.min_lr + coeff * (self.lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::LrSchedule;

    #[test]
    fn warms_up_then_decays_to_the_floor() {
        let s = LrSchedule {
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_iters: 100,
            decay_iters: 2000,
        };
        assert!(s.at(0) < s.at(50) && s.at(50) < s.at(100));
        assert!((s.at(100) - 1e-3).abs() < 1e-12);
        assert!((s.at(2000) - 1e-4).abs() < 1e-12);
        assert_eq!(s.at(5000), 1e-4);
    }
}
