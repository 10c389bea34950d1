//! The per-cell chart: one stacked bar of the memory categories (plotters, SVG).

use plotters::prelude::*;
use tchmem_wire::memory::{category_bytes, Category, CategoryName};

use super::format::human_bytes;

/// Colour of each category, the same in every chart.
fn colour(name: CategoryName) -> RGBColor {
    match name {
        CategoryName::Parameters => RGBColor(66, 133, 244),
        CategoryName::Gradients => RGBColor(52, 168, 83),
        CategoryName::OptimizerState => RGBColor(251, 188, 5),
        CategoryName::Activations => RGBColor(238, 76, 44),
        CategoryName::InputBatch => RGBColor(171, 71, 188),
        CategoryName::Other => RGBColor(158, 158, 158),
        CategoryName::Fragmentation => RGBColor(205, 205, 205),
        CategoryName::CudaContext => RGBColor(96, 125, 139),
    }
}

/// An SVG with one horizontal bar stacked by category and a legend with each category's bytes.
pub fn stacked_bar(title: &str, categories: &[Category]) -> Result<String, String> {
    let present: Vec<(CategoryName, u64)> = CategoryName::ALL
        .iter()
        .map(|&name| (name, category_bytes(categories, name)))
        .filter(|(name, _)| categories.iter().any(|c| c.name == *name))
        .collect();
    let total: u64 = present.iter().map(|(_, bytes)| bytes).sum();
    let (width, height) = (640u32, 90 + 18 * present.len().div_ceil(2) as u32);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let title = format!("{title}: {}", human_bytes(total));
        root.draw(&Text::new(title, (10, 8), ("sans-serif", 14).into_font()))
            .map_err(|e| e.to_string())?;
        let (left, right, top, bar) = (10i32, width as i32 - 10, 30i32, 24i32);
        let span = (right - left) as f64;
        let mut x = left as f64;
        for (name, bytes) in &present {
            let w = if total == 0 {
                0.0
            } else {
                *bytes as f64 / total as f64 * span
            };
            if w > 0.0 {
                let rect = Rectangle::new(
                    [(x.round() as i32, top), ((x + w).round() as i32, top + bar)],
                    colour(*name).filled(),
                );
                root.draw(&rect).map_err(|e| e.to_string())?;
            }
            x += w;
        }
        for (i, (name, bytes)) in present.iter().enumerate() {
            let column = (i % 2) as i32 * (width as i32 / 2);
            let row = top + bar + 14 + (i / 2) as i32 * 18;
            let swatch = Rectangle::new(
                [(left + column, row), (left + column + 12, row + 12)],
                colour(*name).filled(),
            );
            root.draw(&swatch).map_err(|e| e.to_string())?;
            let label = format!("{}: {}", name.label(), human_bytes(*bytes));
            root.draw(&Text::new(
                label,
                (left + column + 18, row),
                ("sans-serif", 12).into_font(),
            ))
            .map_err(|e| e.to_string())?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

/// Most columns `%memhistory` draws; older runs stay in its table.
const MAX_COLUMNS: usize = 120;

/// An SVG with one column per run (the latest [`MAX_COLUMNS`]), stacked by category, for
/// `%memhistory`.
pub fn history_columns(runs: &[(usize, &[Category])]) -> Result<String, String> {
    let runs = &runs[runs.len().saturating_sub(MAX_COLUMNS)..];
    let totals: Vec<u64> = runs
        .iter()
        .map(|(_, categories)| categories.iter().map(|c| c.bytes).sum())
        .collect();
    let highest = totals.iter().copied().max().unwrap_or(0).max(1);
    let (width, height) = (640u32, 220u32);
    let (left, right, top, bottom) = (70i32, width as i32 - 10, 30i32, height as i32 - 30);
    let slot = ((right - left) / runs.len().max(1) as i32).clamp(4, 48);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let font = ("sans-serif", 12).into_font();
        let title = "memory after each run (stacked by category)";
        root.draw(&Text::new(title, (10, 8), ("sans-serif", 14).into_font()))
            .map_err(|e| e.to_string())?;
        root.draw(&Text::new(human_bytes(highest), (4, top), font.clone()))
            .map_err(|e| e.to_string())?;
        root.draw(&Text::new("0", (4, bottom - 12), font.clone()))
            .map_err(|e| e.to_string())?;
        let scale = (bottom - top) as f64 / highest as f64;
        for (i, (run, categories)) in runs.iter().enumerate() {
            let x = left + i as i32 * slot;
            let mut y = bottom as f64;
            for name in CategoryName::ALL {
                let h = category_bytes(categories, name) as f64 * scale;
                if h > 0.0 {
                    let rect = Rectangle::new(
                        [
                            (x, (y - h).round() as i32),
                            (x + slot - 2, y.round() as i32),
                        ],
                        colour(name).filled(),
                    );
                    root.draw(&rect).map_err(|e| e.to_string())?;
                }
                y -= h;
            }
            if runs.len() <= 40 || i % (runs.len() / 20).max(1) == 0 {
                root.draw(&Text::new(run.to_string(), (x, bottom + 6), font.clone()))
                    .map_err(|e| e.to_string())?;
            }
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}
