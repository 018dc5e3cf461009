//! File digests and versioned manifests, shared by a prepared data directory's
//! `manifest.json` (its input files' CRC-32) and a trainer checkpoint's `manifest.json`
//! (every file's [`Hasher64`] digest).
//!
//! ```
//! let dir = std::env::temp_dir().join(format!("candle-data-digest-{}", std::process::id()));
//! std::fs::create_dir_all(&dir)?;
//! let path = dir.join("a.bin");
//! std::fs::write(&path, b"tokens")?;
//! let d = candle_data::digest::file_digest(&path)?;
//! assert_eq!(d.len(), 16);
//! assert_eq!(d, candle_data::digest::file_digest(&path)?);
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};
use crate::hash::Hasher64;

/// Bytes of one piece [`file_digest`] feeds to its hasher (part of the digest's definition:
/// [`Hasher64`] pads each piece).
const DIGEST_PIECE: usize = 8 << 20;

/// Feeds the bytes of `path` to `feed` in pieces of exactly `piece` bytes (the last one
/// shorter), so that piece boundaries never depend on how the OS splits reads.
fn read_pieces(path: &Path, piece: usize, mut feed: impl FnMut(&[u8])) -> Result<()> {
    let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut buf = vec![0u8; piece.max(1)];
    loop {
        let mut n = 0;
        while n < buf.len() {
            match f.read(&mut buf[n..]).map_err(|e| Error::io(path, e))? {
                0 => break,
                k => n += k,
            }
        }
        if n == 0 {
            return Ok(());
        }
        feed(&buf[..n]);
        if n < buf.len() {
            return Ok(());
        }
    }
}

/// The digest of a file's bytes: a [`Hasher64`] fed 8 MiB pieces, as 16 hex digits (what a
/// checkpoint's manifest records for each of its files).
pub fn file_digest(path: &Path) -> Result<String> {
    let mut h = Hasher64::new();
    read_pieces(path, DIGEST_PIECE, |b| h.update(b))?;
    Ok(format!("{:016x}", h.finish()))
}

/// The CRC-32 of a file's bytes, as 8 hex digits (what a prepared directory's manifest
/// records for each input file).
pub(crate) fn file_crc32(path: &Path) -> Result<String> {
    let mut h = crc32fast::Hasher::new();
    read_pieces(path, 1 << 20, |b| h.update(b))?;
    Ok(format!("{:08x}", h.finalize()))
}

/// Refuses a `what` manifest (`"checkpoint"`, `"manifest"`) of format `found` where this
/// code reads `want`, with the error `error` makes of the message.
pub fn check_format(
    what: &str,
    found: u32,
    want: u32,
    error: impl FnOnce(String) -> Error,
) -> Result<()> {
    match found == want {
        true => Ok(()),
        false => Err(error(format!(
            "{what} format {found} (this trainer reads format {want})"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The digest is the hash of exact 8 MiB pieces, whatever the file's size (a piece of
    /// another length padded mid-file would change every checkpoint's digests).
    #[test]
    fn digest_is_hash_of_whole_pieces() {
        let dir = tempfile::tempdir().unwrap();
        let piece = 8 << 20; // the digest's definition: checkpoints record these digests
        let bytes: Vec<u8> = (0..piece + 12_345).map(|i| (i % 251) as u8).collect();
        let path = dir.path().join("w.bin");
        std::fs::write(&path, &bytes).unwrap();
        let mut h = Hasher64::new();
        h.update(&bytes[..piece]);
        h.update(&bytes[piece..]);
        assert_eq!(file_digest(&path).unwrap(), format!("{:016x}", h.finish()));
        let crc = format!("{:08x}", crc32fast::hash(&bytes));
        assert_eq!(file_crc32(&path).unwrap(), crc);
    }

    #[test]
    fn other_format_is_refused_by_name() {
        let err = check_format("checkpoint", 2, 1, |m| {
            Error::checkpoint("x/manifest.json", m)
        });
        let msg = err.unwrap_err().to_string();
        assert!(
            msg.contains("x/manifest.json") && msg.contains("format 2"),
            "{msg}"
        );
        assert!(check_format("checkpoint", 1, 1, Error::Config).is_ok());
    }
}
