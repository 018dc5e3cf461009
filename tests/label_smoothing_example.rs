//! `examples/label_smoothing` runs: its objective, plugged into the trainer, gives the built-in
//! cross-entropy's losses bit for bit at epsilon 0 and other losses at 0.1 (the example checks
//! both and fails otherwise; `trainer/tests/objective.rs` checks the same objective against
//! torch).

#[path = "../examples/label_smoothing/main.rs"]
mod example;

#[test]
fn the_label_smoothing_example_runs() {
    example::main().unwrap();
}
