//! candle-pipeline (work in progress)
