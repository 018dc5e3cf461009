//! Reference values computed once before training (`dpo_precompute_ref`, TRL's
//! `precompute_ref_log_probs`): the initial model's summed log-probability of every preference
//! pair's chosen and rejected completion, so that no second model is held. They are written to
//! the run directory (`dpo_reference.json`, each pair keyed by the line of its record) and read
//! back, checked against the data, when the run resumes.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::Trainer;
use crate::data::{DataSource, Fingerprint};
use crate::model::Ctx;
use crate::{Error, Result};

/// The file in the run directory that holds the reference values.
pub(crate) const REFERENCE_FILE: &str = "dpo_reference.json";

/// What `REFERENCE_FILE` holds: the data and length the values were computed for, and the
/// values of each pair.
#[derive(Debug, Serialize, Deserialize)]
struct ReferenceFile {
    data: Fingerprint,
    block_size: usize,
    pairs: Vec<PairReference>,
}

/// One pair's reference values, keyed by the line of its record.
#[derive(Debug, Serialize, Deserialize)]
struct PairReference {
    line: usize,
    chosen: f32,
    rejected: f32,
}

impl Trainer {
    /// The path of the run's reference values.
    fn reference_path(&self) -> PathBuf {
        self.config.out_dir.join(REFERENCE_FILE)
    }

    /// With `dpo_precompute_ref` and an objective that needs a reference: hands the data
    /// source every pair's reference values, computed by the model now at step 0 (and written
    /// to the run directory), else read back from the run directory and checked against the
    /// data. Nothing otherwise, or when they are set.
    pub(super) fn prepare_reference(&mut self) -> Result<()> {
        if !(self.config.dpo_precompute_ref && self.objective.needs_reference()) {
            return Ok(());
        }
        let Some(source) = self.data.preferences() else {
            return Err(Error::Config(format!(
                "dpo_precompute_ref computes reference values over preference pairs, but the \
                 data is `{}` (use data = preference)",
                self.config.data
            )));
        };
        if source.has_reference() {
            return Ok(());
        }
        let path = self.reference_path();
        let block = self.config.block_size;
        let lines: Vec<usize> = (0..source.pairs().len()).map(|i| source.line(i)).collect();
        let values = if self.step == 0 {
            let ctx = Ctx::eval()
                .with_dtype(self.dtype)
                .with_kernels(self.config.kernels)
                .with_chunked_loss(self.config.chunked_loss);
            let mut values = Vec::with_capacity(lines.len());
            for i in 0..lines.len() {
                let batch = source.pair_batch(i, block, &self.device)?;
                let r = crate::objective::reference_log_probs(self.model.as_ref(), &batch, &ctx)?;
                let r = crate::transfer::read_vec1::<f32>(&r)?;
                values.push([r[0], r[1]]);
            }
            if self.writes && self.dp.is_main() {
                std::fs::create_dir_all(&self.config.out_dir)
                    .map_err(|e| Error::io(&self.config.out_dir, e))?;
                let file = ReferenceFile {
                    data: source.fingerprint(),
                    block_size: block,
                    pairs: lines
                        .iter()
                        .zip(&values)
                        .map(|(&line, v)| PairReference {
                            line,
                            chosen: v[0],
                            rejected: v[1],
                        })
                        .collect(),
                };
                crate::io::write_json(&path, &file)?;
            }
            values
        } else {
            if !path.is_file() {
                return Err(Error::data(
                    &path,
                    "the reference values computed before training are missing (a model past \
                     step 0 cannot recompute them)",
                ));
            }
            let file: ReferenceFile = crate::io::read_json(&path)?;
            let stale = |what: &str| Error::data(&path, format!("computed for {what}"));
            if file.data != source.fingerprint() {
                return Err(stale("other data than this run's"));
            }
            if file.block_size != block {
                return Err(stale(&format!(
                    "block_size {}, not {block}",
                    file.block_size
                )));
            }
            if file.pairs.iter().map(|p| p.line).ne(lines.iter().copied()) {
                return Err(stale("other records than this run's"));
            }
            file.pairs.iter().map(|p| [p.chosen, p.rejected]).collect()
        };
        Ok(source.set_reference(values)?)
    }
}
