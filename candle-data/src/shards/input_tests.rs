use std::path::Path;

use super::*;
use crate::shards::unit::start;

fn units(path: &Path, text: bool, chunk: usize) -> Vec<(u64, u64, Vec<u8>, bool)> {
    let files = [path.to_path_buf()];
    let mut r = UnitReader::new(&files, text, chunk, usize::MAX / 4, start());
    let mut out = Vec::new();
    while let Some(u) = r.next_unit().unwrap() {
        out.push((u.at.offset, u.at.line, u.bytes, u.eof));
    }
    out
}

#[test]
fn units_cover_the_file_at_line_starts_by_the_bytes_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("t.txt");
    let mut text = String::new();
    for i in 0..300 {
        text.push_str(&format!("line {i}\n"));
        if i % 7 == 0 {
            text.push_str("  indented\n\n");
        }
    }
    text.push_str("no newline at the end");
    std::fs::write(&p, &text).unwrap();
    for (is_text, chunk) in [(true, 1), (true, 50), (false, 64), (true, 100_000)] {
        let us = units(&p, is_text, chunk);
        let joined: Vec<u8> = us.iter().flat_map(|u| u.2.clone()).collect();
        assert_eq!(joined, text.as_bytes());
        assert!(us.last().unwrap().3 && us.iter().filter(|u| u.3).count() == 1);
        let mut offset = 0;
        let mut line = 1;
        for (o, l, bytes, _) in &us {
            assert_eq!((*o, *l), (offset, line));
            offset += bytes.len() as u64;
            line += bytes.iter().filter(|&&b| b == b'\n').count() as u64;
            if is_text && chunk > 1 && *o > 0 {
                // Cut before a line that starts with a non-space byte (chunk 1 falls back to
                // any newline after 8 bytes).
                let prev = text.as_bytes()[*o as usize - 1];
                assert!(prev == b'\n' && !bytes[0].is_ascii_whitespace());
            }
        }
    }
    // Lines of spaces only: the text rule falls back to any newline after 8 chunks.
    std::fs::write(&p, " \n".repeat(1000)).unwrap();
    let us = units(&p, true, 10);
    assert!(
        us.len() > 10 && us.iter().all(|u| u.2.len() <= 90),
        "{}",
        us.len()
    );
}

#[test]
fn resuming_at_a_unit_gives_the_same_units() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("a.jsonl");
    let text: String = (0..200)
        .map(|i| format!("{{\"text\": \"{i}\"}}\n"))
        .collect();
    std::fs::write(&p, &text).unwrap();
    let all = units(&p, false, 100);
    let files = [p.clone()];
    let (o, l, ..) = all[3].clone();
    let at = Position {
        offset: o,
        line: l,
        ..Position::default()
    };
    let mut r = UnitReader::new(&files, false, 100, usize::MAX / 4, at);
    let mut rest = Vec::new();
    while let Some(u) = r.next_unit().unwrap() {
        rest.push((u.at.offset, u.at.line, u.bytes, u.eof));
    }
    assert_eq!(rest, all[3..]);
}
