//! The registry of architectures: one line per built-in architecture gives the [`Arch`]
//! a run names (`arch = "llama"`), the [`Architecture`] that reads its `config.json` and
//! makes a fresh model of it, and its place in [`BUILTIN`]. A program (or a test) can also
//! [`register`] one of its own. The registry imports the architectures; they never import it.
//!
//! Adding an architecture: its module (config, `config.json` form, structure over the
//! shared layers) and one line below.

use std::path::Path;
use std::str::FromStr;
use std::sync::RwLock;

use candle_core::Device;

use super::{gemma3, gpt2, llama, Architecture, Builder, Model, ModelConfig, Params};
use crate::{Error, Result};

/// The built-in architectures: `Variant => its Architecture`, one line each; [`Arch`] and
/// [`BUILTIN`] are made from this one table.
macro_rules! registry {
    ($($(#[$attr:meta])* $variant:ident => $arch:expr,)+) => {
        /// The architecture of a fresh model (`arch`), named as its `model_type`.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
        pub enum Arch {
            $($(#[$attr])* $variant,)+
        }

        impl Arch {
            /// Every built-in architecture, in registry order.
            pub(crate) const ALL: &[Arch] = &[$(Arch::$variant),+];

            /// Its [`Architecture`].
            pub fn architecture(self) -> &'static dyn Architecture {
                match self {
                    $(Arch::$variant => &$arch,)+
                }
            }
        }

        /// The architectures the trainer knows: one line each.
        pub(crate) const BUILTIN: &[&dyn Architecture] = &[$(&$arch),+];
    };
}

registry! {
    /// GPT-2 (learned positions, LayerNorm, GELU MLP, tied head).
    #[default]
    Gpt2 => gpt2::Gpt2,
    /// `LlamaForCausalLM`.
    Llama => llama::LLAMA,
    /// `MistralForCausalLM`.
    Mistral => llama::MISTRAL,
    /// `Qwen2ForCausalLM`.
    Qwen2 => llama::QWEN2,
    /// `Qwen3ForCausalLM`.
    Qwen3 => llama::QWEN3,
    /// `Gemma3ForCausalLM` (text).
    Gemma3 => gemma3::Gemma3Arch,
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.architecture().name())
    }
}

// Written and read as its `model_type` (as its flag reads it).
candle_data::serde_as_text!(Arch);

impl FromStr for Arch {
    type Err = String;

    /// The architecture whose `model_type` is `s`; an error lists them all.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if let Some(a) = Arch::ALL.iter().find(|a| a.architecture().name() == s) {
            return Ok(*a);
        }
        let names: Vec<&str> = Arch::ALL.iter().map(|a| a.architecture().name()).collect();
        let list = match names.split_last() {
            Some((last, [])) => last.to_string(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        };
        Err(format!("arch must be {list}, not `{s}`"))
    }
}

static REGISTERED: RwLock<Vec<&'static dyn Architecture>> = RwLock::new(Vec::new());

/// Makes an architecture of the caller's known to every loading path (checkpoints, resume,
/// `--init-from`, eval, sample), after the built-in ones. Registering a name twice keeps the
/// first.
pub fn register(arch: &'static dyn Architecture) {
    let mut r = REGISTERED.write().unwrap_or_else(|e| e.into_inner());
    if !r.iter().any(|a| a.name() == arch.name()) {
        r.push(arch);
    }
}

/// The architecture called `name` (built in or registered).
pub fn architecture(name: &str) -> Option<&'static dyn Architecture> {
    let registered = REGISTERED.read().unwrap_or_else(|e| e.into_inner());
    BUILTIN
        .iter()
        .chain(registered.iter())
        .find(|a| a.name() == name)
        .copied()
}

/// Reads a Hugging Face `config.json` of any known architecture (by its `model_type`; a
/// GPT-2 config without one is read as `gpt2`, as `transformers` does for old checkpoints).
pub fn config_from_hf_json_file(path: &Path) -> Result<Box<dyn ModelConfig>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::checkpoint(path, format!("not valid JSON: {e}")))?;
    let all = || {
        let registered = REGISTERED.read().unwrap_or_else(|e| e.into_inner());
        BUILTIN
            .iter()
            .copied()
            .chain(registered.iter().copied())
            .collect::<Vec<_>>()
    };
    // `model_type` names the architecture; without one, `architectures[0]` (the class); a
    // config with neither is an old GPT-2 one, as transformers reads it.
    let class = json
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(|x| x.as_str());
    let arch = match json.get("model_type").and_then(|x| x.as_str()) {
        Some(name) => architecture(name).ok_or(("model_type", name)),
        None => match class {
            Some(class) => all()
                .into_iter()
                .find(|a| a.class() == class)
                .ok_or(("architectures", class)),
            None => architecture("gpt2").ok_or(("model_type", "gpt2")),
        },
    };
    let arch = arch.map_err(|(key, name)| {
        let known: Vec<&str> = all().iter().map(|a| a.name()).collect();
        Error::checkpoint(
            path,
            format!(
                "`{key}` is `{name}`, which this trainer does not know (known model types: {})",
                known.join(", ")
            ),
        )
    })?;
    // Per-layer structures (a layer's attention window, its parameters' names) are built
    // while reading: their number is bounded before (the memory check comes later).
    for key in ["num_hidden_layers", "n_layer"] {
        if let Some(n) = json.get(key).and_then(|v| v.as_u64()) {
            if n > MAX_LAYERS as u64 {
                return Err(Error::checkpoint(
                    path,
                    format!(
                        "`{key}` is {n}: more than the {MAX_LAYERS} layers this trainer builds"
                    ),
                ));
            }
        }
    }
    arch.config_from_hf_json(&json, path)
}

/// The most transformer blocks a model may have (`n_layer`, `num_hidden_layers`): checked
/// before anything with one entry per layer is built, so that a mistyped count is an error,
/// not an allocation of its size. Far beyond any model a memory can hold.
pub const MAX_LAYERS: usize = 1 << 20;

/// Builds `config`'s model over `params` (which must have exactly its names and shapes).
pub fn build(config: &dyn ModelConfig, params: &Params) -> Result<Box<dyn Model>> {
    config.validate()?;
    params.check(config)?;
    config.build(&Builder::root(&|name, _| params.tensor(name)))
}

/// A freshly initialised model of `config` and its parameters: [`ModelConfig::init`] over
/// the parameters in sorted name order, from a ChaCha RNG seeded with `seed` (the same seed
/// gives the same weights on every device).
pub fn init(
    config: &dyn ModelConfig,
    seed: u64,
    device: &Device,
) -> Result<(Box<dyn Model>, Params)> {
    config.validate()?;
    let params = Params::init(config, seed, device)?;
    let model = build(config, &params)?;
    Ok((model, params))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Dims;

    #[test]
    fn arch_is_the_registry() {
        assert_eq!(Arch::ALL.len(), BUILTIN.len());
        for (a, b) in Arch::ALL.iter().zip(BUILTIN) {
            assert_eq!(a.architecture().name(), b.name());
            assert_eq!(a.to_string().parse::<Arch>(), Ok(*a));
        }
        assert_eq!(Arch::default(), Arch::Gpt2);
        assert_eq!(
            "gpt3".parse::<Arch>().unwrap_err(),
            "arch must be gpt2, llama, mistral, qwen2, qwen3 or gemma3_text, not `gpt3`"
        );
    }

    #[test]
    fn fresh_models_have_the_run_dims() {
        let run = Dims {
            layers: 2,
            hidden: 48,
            heads: 4,
            vocab: 40,
            positions: 16,
            tied: true,
            ..Dims::default()
        };
        for a in Arch::ALL {
            let cfg = a.architecture().fresh(&run, 0.0, 10000.0).unwrap();
            let d = cfg.dims();
            assert_eq!(cfg.architecture(), a.architecture().name());
            assert_eq!(
                (d.layers, d.hidden, d.heads, d.kv_heads),
                (2, 48, 4, 4),
                "{a}"
            );
            assert_eq!((d.head_dim, d.vocab, d.positions), (12, 40, 16), "{a}");
            // GPT-2's MLP is 4 C; the Llama family's default is 8 C / 3 rounded up to 64.
            let mlp = if *a == Arch::Gpt2 { 192 } else { 128 };
            assert_eq!(d.mlp, mlp, "{a}");
            assert_eq!(cfg.shape().n_embd, 48);
            assert_eq!(cfg.vocab_size(), 40);
            assert_eq!(cfg.max_positions(), 16);
        }
    }
}
