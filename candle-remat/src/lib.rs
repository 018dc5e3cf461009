//! candle-remat (work in progress)
