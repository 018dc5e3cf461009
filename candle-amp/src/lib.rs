//! candle-amp (work in progress)
