#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

pub mod alloc;
pub mod compare;
pub mod fs;
pub mod grad;
pub mod random;
