//! Every byte the `trainer` binary writes to its terminal goes through here.
//!
//! A closed stdout or stderr (`trainer train ... 2>&1 | head -3`, a terminal that went away)
//! must never stop a run or its signal handling. Rust ignores SIGPIPE, so a write to a
//! stream whose reader is gone fails with EPIPE, and `println!`/`eprintln!` panic on that: the
//! main thread would exit with 101 before its checkpoint, and the signal thread would die,
//! leaving SIGTERM/SIGINT ignored. These writers swallow every write error instead: output
//! nobody can read is dropped, and the run goes on and saves as usual.
//!
//! `std::{print, println, eprint, eprintln}` are disallowed in this crate (clippy.toml), so
//! every print uses [`out!`], [`outln!`] or [`errln!`]; the tracing subscriber writes through
//! [`Stderr`]; indicatif ignores write errors on its own.

use std::fmt;
use std::io::{self, Write};

/// `print!` that never panics: a failed write to stdout is dropped.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::term::stdout(format_args!($($arg)*), false)
    };
}

/// `println!` that never panics: a failed write to stdout is dropped.
macro_rules! outln {
    () => {
        $crate::term::stdout(format_args!(""), true)
    };
    ($($arg:tt)*) => {
        $crate::term::stdout(format_args!($($arg)*), true)
    };
}

/// `eprintln!` that never panics: a failed write to stderr is dropped.
macro_rules! errln {
    () => {
        $crate::term::stderr(format_args!(""), true)
    };
    ($($arg:tt)*) => {
        $crate::term::stderr(format_args!($($arg)*), true)
    };
}

fn write_to(mut w: impl Write, args: fmt::Arguments<'_>, newline: bool) {
    let _ = w.write_fmt(args);
    if newline {
        let _ = w.write_all(b"\n");
    }
}

pub(crate) fn stdout(args: fmt::Arguments<'_>, newline: bool) {
    write_to(io::stdout().lock(), args, newline);
}

/// Writes `text` to stdout and flushes it (streamed output); false when stdout is closed (its
/// reader went away, as in `trainer sample ... | head -1`), so the caller can stop.
pub(crate) fn stdout_open(text: &str) -> bool {
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes()).is_ok() && out.flush().is_ok()
}

pub(crate) fn stderr(args: fmt::Arguments<'_>, newline: bool) {
    write_to(io::stderr().lock(), args, newline);
}

/// Stderr for the tracing subscriber: every write "succeeds", whatever became of the stream.
pub(crate) struct Stderr;

impl Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let _ = io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let _ = io::stderr().flush();
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = Stderr;

    fn make_writer(&'a self) -> Stderr {
        Stderr
    }
}
