//! Loss scalers: static and dynamic (PyTorch `GradScaler` defaults plus DeepSpeed-style
//! hysteresis, minimum and maximum scale).

use crate::error::{AmpError, Result};
use crate::state::ScalerState;

/// What to do when the dynamic scale must back off but is already at its minimum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CollapsePolicy {
    /// Return [`AmpError::ScaleCollapse`] with a diagnosis (the default).
    #[default]
    Error,
    /// Keep the scale at its minimum, skip the step and report it as collapsed.
    Continue,
}

/// Whether the scale adapts to overflows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScalerKind {
    /// A fixed scale; overflowing steps are skipped but the scale never changes.
    Static,
    /// A scale that backs off on overflow and grows after a run of clean steps.
    Dynamic,
}

/// Configuration of the loss scaler of an [`Amp`](crate::Amp), built with chained setters.
///
/// ```
/// use candle_amp::{CollapsePolicy, ScalerConfig};
/// let cfg = ScalerConfig::dynamic()
///     .init_scale(1024.0)
///     .growth_interval(500)
///     .hysteresis(2)
///     .min_scale(1.0)
///     .collapse_policy(CollapsePolicy::Continue);
/// assert_eq!(cfg.init_scale, 1024.0);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ScalerConfig {
    /// Static or dynamic.
    pub kind: ScalerKind,
    /// Initial scale (dynamic) or the fixed scale (static). Default `2^16`.
    pub init_scale: f64,
    /// Multiplier applied after `growth_interval` consecutive clean steps. Default `2.0`.
    pub growth_factor: f64,
    /// Multiplier applied on an overflow that is not absorbed by hysteresis. Default `0.5`.
    pub backoff_factor: f64,
    /// Number of consecutive clean steps before the scale grows. Default `2000`.
    pub growth_interval: u64,
    /// Number of overflows tolerated before backing off (DeepSpeed's `delayed_shift`).
    /// `1` (the default) backs off on every overflow, as PyTorch does.
    pub hysteresis: u32,
    /// If true, every clean step refills the hysteresis budget; otherwise only a growth
    /// does (DeepSpeed's `consecutive_hysteresis`). Default `false`.
    pub consecutive_hysteresis: bool,
    /// Smallest allowed scale. Default `1.0`. A backoff that would go below it is clamped to
    /// it; an overflow while the scale is already at the minimum is a collapse (see
    /// [`CollapsePolicy`]).
    pub min_scale: f64,
    /// Largest allowed scale. Default `2^24`.
    pub max_scale: f64,
    /// What happens when the scale is at `min_scale` and must back off again.
    pub collapse: CollapsePolicy,
}

impl Default for ScalerConfig {
    fn default() -> Self {
        Self::dynamic()
    }
}

/// Builder setters: `name(arg: Type) => field;` is `pub fn name(mut self, arg: Type) -> Self`
/// setting `field`, with the doc comment written above it.
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident($arg:ident: $ty:ty) => $field:ident;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, $arg: $ty) -> Self {
                self.$field = $arg;
                self
            }
        )*
    };
}

impl ScalerConfig {
    /// Dynamic scaling with PyTorch `GradScaler` defaults: init `2^16`, growth x2 every 2000
    /// clean steps, backoff x0.5; no hysteresis, scale bounded to `[1, 2^24]`.
    pub fn dynamic() -> Self {
        Self {
            kind: ScalerKind::Dynamic,
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            hysteresis: 1,
            consecutive_hysteresis: false,
            min_scale: 1.0,
            max_scale: 16_777_216.0,
            collapse: CollapsePolicy::Error,
        }
    }

    /// A fixed scale. Overflowing steps are still detected and skipped.
    pub fn static_scale(scale: f64) -> Self {
        Self {
            kind: ScalerKind::Static,
            init_scale: scale,
            min_scale: scale.min(1.0),
            max_scale: scale.max(1.0),
            ..Self::dynamic()
        }
    }

    /// No scaling (static scale 1): the usual choice for bf16, whose range matches f32.
    /// Non-finite gradients are still detected and the step skipped.
    pub fn none() -> Self {
        Self::static_scale(1.0)
    }

    setters! {
        /// Sets the initial scale.
        init_scale(scale: f64) => init_scale;
        /// Sets the growth factor (must be >= 1).
        growth_factor(factor: f64) => growth_factor;
        /// Sets the backoff factor (must be in `(0, 1)`).
        backoff_factor(factor: f64) => backoff_factor;
        /// Sets the number of clean steps between growths (must be >= 1).
        growth_interval(steps: u64) => growth_interval;
        /// Sets the hysteresis: how many overflows are needed before the scale backs off.
        hysteresis(overflows: u32) => hysteresis;
        /// Sets whether each clean step (rather than each growth) refills the hysteresis.
        consecutive_hysteresis(on: bool) => consecutive_hysteresis;
        /// Sets the minimum scale.
        min_scale(scale: f64) => min_scale;
        /// Sets the maximum scale.
        max_scale(scale: f64) => max_scale;
        /// Sets the collapse policy.
        collapse_policy(policy: CollapsePolicy) => collapse;
    }

    /// Checks that the values are usable.
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(AmpError::Config(msg));
        let pos = |x: f64| x.is_finite() && x > 0.0;
        if !pos(self.init_scale) {
            return bad(format!(
                "init_scale must be finite and > 0, got {}",
                self.init_scale
            ));
        }
        if self.kind == ScalerKind::Static {
            return Ok(());
        }
        if !(self.growth_factor.is_finite() && self.growth_factor >= 1.0) {
            return bad(format!(
                "growth_factor must be >= 1, got {}",
                self.growth_factor
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad(format!(
                "backoff_factor must be in (0, 1), got {}",
                self.backoff_factor
            ));
        }
        if self.growth_interval == 0 {
            return bad("growth_interval must be >= 1".into());
        }
        if self.hysteresis == 0 {
            return bad("hysteresis must be >= 1".into());
        }
        if !pos(self.min_scale) || !pos(self.max_scale) || self.min_scale > self.max_scale {
            return bad(format!(
                "need 0 < min_scale <= max_scale (finite), got min {} max {}",
                self.min_scale, self.max_scale
            ));
        }
        if self.init_scale < self.min_scale || self.init_scale > self.max_scale {
            return bad(format!(
                "init_scale {} outside [min_scale {}, max_scale {}]",
                self.init_scale, self.min_scale, self.max_scale
            ));
        }
        Ok(())
    }
}

/// How the scale changed in one update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleChange {
    /// The scale did not change.
    Unchanged,
    /// The scale grew after `growth_interval` clean steps.
    Grew,
    /// The scale backed off after an overflow.
    BackedOff,
    /// An overflow was absorbed by the hysteresis budget; the scale did not change.
    HysteresisAbsorbed,
    /// The scale was already at its minimum and could not back off.
    Collapsed,
}

/// The scale before and after one update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ScaleUpdate {
    /// Scale used for the step.
    pub before: f64,
    /// Scale for the next step.
    pub after: f64,
    /// What happened.
    pub change: ScaleChange,
}

/// A loss scaler: its [`ScalerConfig`] plus the mutable [`ScalerState`]. [`Amp`](crate::Amp)
/// drives it: [`on_overflow`](Self::on_overflow) or [`on_clean`](Self::on_clean), then
/// [`finish_step`](Self::finish_step), once per step (PyTorch's `GradScaler.update`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LossScaler {
    config: ScalerConfig,
    state: ScalerState,
}

impl LossScaler {
    /// Creates a scaler at its initial scale; fails if the configuration is invalid.
    pub fn new(config: ScalerConfig) -> Result<Self> {
        config.validate()?;
        let state = ScalerState::initial(config.init_scale, config.hysteresis);
        Ok(Self { config, state })
    }

    /// The configuration.
    pub fn config(&self) -> &ScalerConfig {
        &self.config
    }

    /// The current state (scale, trackers, counters).
    pub fn state(&self) -> &ScalerState {
        &self.state
    }

    /// Replaces the state, e.g. after loading a checkpoint.
    pub fn set_state(&mut self, state: ScalerState) -> Result<()> {
        if !(state.scale.is_finite() && state.scale > 0.0) {
            return Err(AmpError::State(format!(
                "scale {} is not positive",
                state.scale
            )));
        }
        self.state = state;
        Ok(())
    }

    /// The scale to multiply the loss with for the next step.
    pub fn scale(&self) -> f64 {
        self.state.scale
    }

    /// Registers an overflow: resets the growth tracker and backs off unless hysteresis
    /// absorbs it. A collapse is reported in the returned change; the policy is applied by
    /// the caller.
    pub fn on_overflow(&mut self) -> ScaleUpdate {
        let st = &mut self.state;
        let before = st.scale;
        st.overflows += 1;
        st.growth_tracker = 0;
        let change = match self.config.kind {
            ScalerKind::Static => ScaleChange::Unchanged,
            ScalerKind::Dynamic if st.hysteresis_left > 1 => {
                st.hysteresis_left -= 1;
                ScaleChange::HysteresisAbsorbed
            }
            ScalerKind::Dynamic if st.scale <= self.config.min_scale => ScaleChange::Collapsed,
            ScalerKind::Dynamic => {
                st.scale = (st.scale * self.config.backoff_factor).max(self.config.min_scale);
                st.backoffs += 1;
                ScaleChange::BackedOff
            }
        };
        ScaleUpdate {
            before,
            after: st.scale,
            change,
        }
    }

    /// Registers a clean step: advances the growth tracker and grows the scale when due.
    pub fn on_clean(&mut self) -> ScaleUpdate {
        let cfg = &self.config;
        let st = &mut self.state;
        let before = st.scale;
        let mut change = ScaleChange::Unchanged;
        if cfg.kind == ScalerKind::Dynamic {
            if cfg.consecutive_hysteresis {
                st.hysteresis_left = cfg.hysteresis;
            }
            st.growth_tracker += 1;
            if st.growth_tracker >= cfg.growth_interval {
                st.growth_tracker = 0;
                st.hysteresis_left = cfg.hysteresis;
                let grown = (st.scale * cfg.growth_factor).min(cfg.max_scale);
                if grown != st.scale {
                    st.scale = grown;
                    st.growths += 1;
                    change = ScaleChange::Grew;
                }
            }
        }
        ScaleUpdate {
            before,
            after: st.scale,
            change,
        }
    }

    /// Counts a finished step as applied or skipped.
    pub fn finish_step(&mut self, applied: bool) {
        let st = &mut self.state;
        st.steps += 1;
        if applied {
            st.applied += 1;
            st.consecutive_skips = 0;
        } else {
            st.skipped += 1;
            st.consecutive_skips += 1;
        }
    }
}
