//! The per-cell chart: one stacked bar of the memory categories (plotters, SVG).

use plotters::prelude::*;
use tchmem_wire::memory::{category_bytes, Category, CategoryName};

use super::format::human_bytes;

/// Colour of each category, the same in every chart.
pub(super) fn colour(name: CategoryName) -> RGBColor {
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

/// Font sizes in pixels, for a 640 px wide chart that a notebook shows at about its size.
pub(super) const TITLE_PX: f64 = 18.0;
pub(super) const TEXT_PX: f64 = 14.0;

/// plotters writes `font-size` as the size it is given divided by 1.24 (a 12 "pt" label
/// became 9.7 px): sizes in pixels are scaled up by that much before they are handed over.
pub(super) fn font(px: f64) -> FontDesc<'static> {
    ("sans-serif", px * 1.24).into_font()
}
/// Height of one legend row.
const ROW_PX: i32 = 22;

/// The categories that hold bytes, in the chart's order (the summary line leaves out empty
/// ones; so do the charts).
fn non_empty(categories: &[Category]) -> Vec<(CategoryName, u64)> {
    CategoryName::ALL
        .iter()
        .map(|&name| (name, category_bytes(categories, name)))
        .filter(|(_, bytes)| *bytes > 0)
        .collect()
}

/// Draws a two-column legend of `entries` from `top`; returns the y below it.
fn legend<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    entries: &[(CategoryName, String)],
    left: i32,
    top: i32,
    width: i32,
) -> Result<i32, String> {
    for (i, (name, label)) in entries.iter().enumerate() {
        let column = (i % 2) as i32 * (width / 2);
        let row = top + (i / 2) as i32 * ROW_PX;
        let swatch = Rectangle::new(
            [(left + column, row), (left + column + 14, row + 14)],
            colour(*name).filled(),
        );
        root.draw(&swatch).map_err(|e| e.to_string())?;
        root.draw(&Text::new(
            label.clone(),
            (left + column + 20, row),
            font(TEXT_PX),
        ))
        .map_err(|e| e.to_string())?;
    }
    Ok(top + entries.len().div_ceil(2) as i32 * ROW_PX)
}

/// An SVG with one horizontal bar stacked by category and a legend with each category's bytes.
pub fn stacked_bar(title: &str, categories: &[Category]) -> Result<String, String> {
    bar(title, categories, None)
}

/// [`stacked_bar`] against a capacity: the bar's scale reaches the larger of the two, and a
/// vertical line marks the capacity (the device's memory, for an estimate).
pub fn stacked_bar_against(
    title: &str,
    categories: &[Category],
    capacity: u64,
) -> Result<String, String> {
    bar(title, categories, Some(capacity))
}

fn bar(title: &str, categories: &[Category], capacity: Option<u64>) -> Result<String, String> {
    let present = non_empty(categories);
    let total: u64 = present.iter().map(|(_, bytes)| bytes).sum();
    let scale = total.max(capacity.unwrap_or(0));
    let (width, height) = (
        640u32,
        96 + ROW_PX as u32 * present.len().div_ceil(2) as u32
            + if capacity.is_some() { 18 } else { 0 },
    );
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let title = format!("{title}: {}", human_bytes(total));
        root.draw(&Text::new(title, (10, 8), font(TITLE_PX)))
            .map_err(|e| e.to_string())?;
        let (left, right, top, bar) = (10i32, width as i32 - 10, 36i32, 28i32);
        let span = (right - left) as f64;
        let mut x = left as f64;
        for (name, bytes) in &present {
            let w = if scale == 0 {
                0.0
            } else {
                *bytes as f64 / scale as f64 * span
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
        if let Some(capacity) = capacity.filter(|_| scale > 0) {
            let at = left + (capacity as f64 / scale as f64 * span).round() as i32;
            root.draw(&PathElement::new(
                [(at, top - 6), (at, top + bar + 6)],
                BLACK.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?;
            let label = format!("capacity {}", human_bytes(capacity));
            let x = (at - 150).max(left);
            root.draw(&Text::new(label, (x, top + bar + 8), font(TEXT_PX)))
                .map_err(|e| e.to_string())?;
        }
        let entries: Vec<(CategoryName, String)> = present
            .iter()
            .map(|(name, bytes)| (*name, format!("{}: {}", name.label(), human_bytes(*bytes))))
            .collect();
        let legend_top = top + bar + if capacity.is_some() { 32 } else { 14 };
        legend(&root, &entries, left, legend_top, width as i32)?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

/// Most columns `%memhistory` draws; older runs stay in its table.
const MAX_COLUMNS: usize = 120;

/// An SVG with one column per run (the latest [`MAX_COLUMNS`]), stacked by category, for
/// `%memhistory`.
pub fn history_columns(runs: &[(usize, &[Category])]) -> Result<String, String> {
    stacked_columns(
        "memory after each run (stacked by category)",
        "run (the cell's execution count)",
        runs,
    )
}

/// An SVG with one column per rank of a `%%distributed` world, stacked by category.
pub fn rank_columns(ranks: &[(usize, &[Category])]) -> Result<String, String> {
    stacked_columns(
        "memory of each rank after the cell (stacked by category)",
        "rank",
        ranks,
    )
}

/// An SVG with one column per numbered record (the latest [`MAX_COLUMNS`]), stacked by
/// category: `title` above, `axis` under the numbers.
fn stacked_columns(
    title: &str,
    axis: &str,
    runs: &[(usize, &[Category])],
) -> Result<String, String> {
    let runs = &runs[runs.len().saturating_sub(MAX_COLUMNS)..];
    let totals: Vec<u64> = runs
        .iter()
        .map(|(_, categories)| categories.iter().map(|c| c.bytes).sum())
        .collect();
    let highest = totals.iter().copied().max().unwrap_or(0).max(1);
    // Categories any run holds, for the legend.
    let shown: Vec<(CategoryName, String)> = CategoryName::ALL
        .into_iter()
        .filter(|&name| {
            runs.iter()
                .any(|(_, categories)| category_bytes(categories, name) > 0)
        })
        .map(|name| (name, name.label().to_string()))
        .collect();
    let legend_rows = shown.len().div_ceil(2) as i32;
    let width = 640u32;
    let (left, right, top, bottom) = (84i32, width as i32 - 12, 40i32, 250i32);
    let height = (bottom + 44 + legend_rows * ROW_PX) as u32;
    let slot = ((right - left) / runs.len().max(1) as i32).clamp(4, 48);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let text = font(TEXT_PX);
        root.draw(&Text::new(title, (10, 8), font(TITLE_PX)))
            .map_err(|e| e.to_string())?;
        let scale = (bottom - top) as f64 / highest as f64;
        // The y axis: a labelled grid line at 0, ¼, ½, ¾ and all of the highest run.
        for quarter in 0..=4u64 {
            let bytes = highest * quarter / 4;
            let y = bottom - (bytes as f64 * scale).round() as i32;
            root.draw(&PathElement::new(
                [(left - 4, y), (right, y)],
                RGBColor(225, 225, 225),
            ))
            .map_err(|e| e.to_string())?;
            let label = if quarter == 0 {
                "0".to_string()
            } else {
                human_bytes(bytes)
            };
            root.draw(&Text::new(label, (6, y - 7), text.clone()))
                .map_err(|e| e.to_string())?;
        }
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
            if runs.len() <= 20 || i % (runs.len() / 10).max(1) == 0 {
                root.draw(&Text::new(run.to_string(), (x, bottom + 6), text.clone()))
                    .map_err(|e| e.to_string())?;
            }
        }
        root.draw(&Text::new(axis, (left, bottom + 24), text.clone()))
            .map_err(|e| e.to_string())?;
        legend(&root, &shown, left, bottom + 48, width as i32 - left)?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn category(name: CategoryName, bytes: u64) -> Category {
        Category {
            name,
            bytes,
            exact: true,
            how: String::new(),
        }
    }

    #[test]
    fn empty_categories_stay_out_of_the_legend() {
        let categories = [
            category(CategoryName::Parameters, 4 << 20),
            category(CategoryName::Gradients, 0),
        ];
        let svg = stacked_bar("cuda:0", &categories).unwrap();
        assert!(svg.contains("parameters: 4.0 MiB"), "{svg}");
        assert!(!svg.contains("gradients"), "{svg}");
        assert!(svg.contains("font-size=\"18\""), "{svg}");
    }

    #[test]
    fn history_has_a_labelled_y_axis_and_a_legend() {
        let first = [category(CategoryName::Parameters, 1 << 30)];
        let second = [
            category(CategoryName::Parameters, 1 << 30),
            category(CategoryName::OptimizerState, 1 << 30),
        ];
        let svg = history_columns(&[(1, &first[..]), (2, &second[..])]).unwrap();
        for label in [
            "2.0 GiB",
            "1.0 GiB",
            "512.0 MiB",
            "optimizer state",
            "run (",
        ] {
            assert!(svg.contains(label), "{label} missing: {svg}");
        }
        assert!(!svg.contains("gradients"), "{svg}");
    }
}
