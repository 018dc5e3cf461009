//! trainer (work in progress)
