//! Timelines (predicted or measured): busy / idle time, bubble, ASCII chart and SVG.

use std::fmt::Write as _;

use crate::action::Action;

/// One action of one worker on a timeline (seconds for measured timelines, cost units for
/// predicted ones).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    /// The action.
    pub action: Action,
    /// Start time.
    pub start: f64,
    /// End time.
    pub end: f64,
}

/// The actions of every worker over one step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Timeline {
    /// `spans[w]`: the spans of worker `w`, in execution order.
    pub spans: Vec<Vec<Span>>,
}

impl Timeline {
    /// A timeline from per-worker spans.
    pub fn new(spans: Vec<Vec<Span>>) -> Self {
        Self { spans }
    }

    /// Number of workers.
    pub fn workers(&self) -> usize {
        self.spans.len()
    }

    /// Time from 0 to the end of the last action.
    pub fn makespan(&self) -> f64 {
        self.spans
            .iter()
            .flatten()
            .map(|s| s.end)
            .fold(0.0, f64::max)
    }

    /// Busy time (sum of action durations) per worker.
    pub fn busy(&self) -> Vec<f64> {
        self.spans
            .iter()
            .map(|w| w.iter().map(|s| s.end - s.start).sum())
            .collect()
    }

    /// Idle time per worker over the makespan.
    pub fn idle(&self) -> Vec<f64> {
        let t = self.makespan();
        self.busy().into_iter().map(|b| t - b).collect()
    }

    /// Bubble fraction: `1 - sum(busy) / (workers * makespan)`.
    pub fn bubble(&self) -> f64 {
        let t = self.makespan();
        if t <= 0.0 || self.spans.is_empty() {
            return 0.0;
        }
        1.0 - self.busy().iter().sum::<f64>() / (self.workers() as f64 * t)
    }

    /// ASCII chart, one row per worker and `width` columns: digits are forwards, letters
    /// backwards (`a` = microbatch 0, ...), both modulo 10 / 26; `.` is idle.
    pub fn ascii(&self, width: usize) -> String {
        let t = self.makespan();
        let width = width.max(1);
        let mut out = String::new();
        for (w, spans) in self.spans.iter().enumerate() {
            let mut row = vec!['.'; width];
            for s in spans {
                let c = match s.action {
                    Action::Forward { mb, .. } => char::from(b'0' + (mb % 10) as u8),
                    Action::Backward { mb, .. } => char::from(b'a' + (mb % 26) as u8),
                };
                let (a, b) = if t > 0.0 {
                    (
                        (s.start / t * width as f64).round() as usize,
                        (s.end / t * width as f64).round() as usize,
                    )
                } else {
                    (0, 0)
                };
                for cell in row.iter_mut().take(b.min(width)).skip(a) {
                    *cell = c;
                }
            }
            let _ = writeln!(out, "w{w:<2}|{}|", row.into_iter().collect::<String>());
        }
        let _ = writeln!(
            out,
            "makespan {:.4}, bubble {:.1}%  (digits: forward of mb, letters: backward of mb)",
            t,
            100.0 * self.bubble()
        );
        out
    }

    /// Self-contained SVG chart: one lane per worker, forwards blue, backwards orange, labelled
    /// with the microbatch (and virtual stage).
    pub fn svg(&self, title: &str) -> String {
        let (lane, left, top, width) = (28.0, 60.0, 30.0, 900.0);
        let t = self.makespan().max(f64::MIN_POSITIVE);
        let h = top + lane * self.workers() as f64 + 30.0;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{h}" font-family="monospace" font-size="10">"#,
            left + width + 20.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="18" font-size="13">{} (bubble {:.1}%)</text>"#,
            escape(title),
            100.0 * self.bubble()
        );
        for (w, spans) in self.spans.iter().enumerate() {
            let y = top + lane * w as f64;
            let _ = writeln!(s, r#"<text x="4" y="{}">worker {w}</text>"#, y + lane * 0.6);
            for sp in spans {
                let x = left + sp.start / t * width;
                let wd = ((sp.end - sp.start) / t * width).max(0.5);
                let (fill, label) = match sp.action {
                    Action::Forward { mb, stage } => ("#4c78a8", format!("F{mb}.{stage}")),
                    Action::Backward { mb, stage } => ("#f58518", format!("B{mb}.{stage}")),
                };
                let _ = writeln!(
                    s,
                    r#"<rect x="{x:.2}" y="{:.2}" width="{wd:.2}" height="{:.2}" fill="{fill}" stroke="white" stroke-width="0.5"><title>{label} {:.6}..{:.6}</title></rect>"#,
                    y + 2.0,
                    lane - 4.0,
                    sp.start,
                    sp.end
                );
                if wd > 28.0 {
                    let _ = writeln!(
                        s,
                        r#"<text x="{:.2}" y="{:.2}" fill="white">{label}</text>"#,
                        x + 2.0,
                        y + lane * 0.6
                    );
                }
            }
        }
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="{:.2}">0 .. {:.6} (makespan)</text></svg>"#,
            h - 8.0,
            self.makespan()
        );
        s
    }
}

fn escape(x: &str) -> String {
    x.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
