//! The loss curve (`loss.svg`): training loss per step and train/val loss at evaluations.

use std::path::Path;

use plotters::prelude::*;

use crate::metrics::Record;
use crate::{Error, Result};

/// Draws the loss curves of `records` into an SVG file at `path` (written atomically).
pub fn loss_curve(path: &Path, title: &str, records: &[Record]) -> Result<()> {
    let mut steps = Vec::new();
    let mut train = Vec::new();
    let mut val = Vec::new();
    for r in records {
        match r {
            Record::Step(s) if s.loss.is_finite() => steps.push((s.step as f64, s.loss as f64)),
            Record::Eval(e) => {
                train.push((e.step as f64, e.train_loss as f64));
                val.push((e.step as f64, e.val_loss as f64));
            }
            _ => {}
        }
    }
    let all = steps.iter().chain(&train).chain(&val);
    let x_max = all.clone().map(|p| p.0).fold(1.0, f64::max);
    let y_max = all.clone().map(|p| p.1).fold(f64::MIN, f64::max);
    let y_min = all.map(|p| p.1).fold(f64::MAX, f64::min);
    if y_max < y_min {
        return Ok(()); // nothing to draw yet
    }
    let pad = ((y_max - y_min) * 0.05).max(1e-3);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 540)).into_drawing_area();
        let err = |e: &dyn std::fmt::Display| Error::io(path, std::io::Error::other(e.to_string()));
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..x_max, (y_min - pad)..(y_max + pad))
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_desc("loss")
            .draw()
            .map_err(|e| err(&e))?;
        let series = [
            ("train (step)", &steps, RGBColor(160, 190, 230)),
            ("train (eval)", &train, RGBColor(30, 90, 200)),
            ("val (eval)", &val, RGBColor(220, 80, 30)),
        ];
        for (name, points, color) in series {
            if points.is_empty() {
                continue;
            }
            chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(|e| err(&e))?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(crate::checkpoint::io::write_atomic(path, svg.as_bytes())?)
}
