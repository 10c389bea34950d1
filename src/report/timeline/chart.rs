//! The timeline chart: stacked areas by category over the trace's allocation events, the cache
//! above them, phase bands behind, the peak and OOMs marked, a legend, and hover text on every
//! column and on the peak: SVG `<title>`s in a saved chart, an image map in a notebook (see
//! [`crate::report::embed`]). Drawn with plotters' primitives, as the other charts; plotters
//! has no `<title>`, so the hover layer is added to its SVG.

use std::fmt::Write as _;

use plotters::prelude::*;
use tchmem_wire::memory::CategoryName;
use tchmem_wire::timeline::Phase;

use super::{by_category, ms, phase_at, text, PeakBlock};
use crate::report::chart::{colour, font, TEXT_PX, TITLE_PX};
use crate::report::embed::{self, Hover, Spot};
use crate::report::format::human_bytes;
use crate::timeline::model::{Timeline, STACKED};
use crate::timeline::series::{columns, Column};
use crate::timeline::sites::CellSources;

/// Columns drawn (and hover targets): enough for a 640 px chart, few enough to stay small.
pub const COLUMNS: usize = 360;

const WIDTH: i32 = 640;
const LEFT: i32 = 84;
const RIGHT: i32 = WIDTH - 12;
const TOP: i32 = 40;
const BOTTOM: i32 = 290;
/// Height of a legend row.
const ROW: i32 = 22;

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;

fn failed(error: DrawingAreaErrorKind<std::io::Error>) -> String {
    error.to_string()
}

fn phase_colour(phase: Phase) -> RGBColor {
    match phase {
        Phase::Data => RGBColor(225, 205, 235),
        Phase::Forward => RGBColor(253, 221, 200),
        Phase::Backward => RGBColor(205, 235, 210),
        Phase::Step => RGBColor(254, 240, 190),
        Phase::Other => RGBColor(240, 240, 240),
    }
}

/// A "nice" axis top and step above `bytes`.
fn axis(bytes: u64) -> (u64, u64) {
    let bytes = bytes.max(1);
    let unit = [1u64 << 30, 1 << 20, 1 << 10, 1]
        .into_iter()
        .find(|&u| bytes >= u)
        .unwrap_or(1);
    let value = bytes as f64 / unit as f64;
    let step = [
        0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0, 20.0, 25.0, 50.0, 100.0, 200.0, 250.0, 500.0,
    ]
    .into_iter()
    .find(|s| value / s <= 5.0)
    .unwrap_or(1000.0);
    let top = (value / step).ceil() * step;
    ((top * unit as f64) as u64, (step * unit as f64) as u64)
}

/// The hover text of one column: its events and times, phase, bytes by category, and the
/// largest block allocated in it (with its site when stacks were kept).
fn column_title(timeline: &Timeline, column: &Column, sources: &CellSources) -> String {
    let phase = phase_at(timeline, column.at_us)
        .map(|p| format!(" ({})", p.label()))
        .unwrap_or_default();
    let mut text = format!(
        "events {}–{}, {:.2}–{:.2} ms{phase}\nallocated {}, reserved {}",
        column.changes.0 + 1,
        column.changes.1,
        ms(timeline, column.start_us),
        ms(timeline, column.end_us),
        human_bytes(column.state.allocated()),
        human_bytes(column.state.reserved)
    );
    for (c, b) in by_category(&column.state) {
        let _ = write!(text, "\n{}: {}", c.label(), human_bytes(b));
    }
    let largest = timeline.changes[column.changes.0..column.changes.1]
        .iter()
        .filter(|c| c.bytes > 0)
        .filter_map(|c| c.block)
        .max_by_key(|&b| timeline.blocks[b].size);
    if let Some(b) = largest {
        let block = PeakBlock::of(timeline, b, sources);
        let _ = write!(
            text,
            "\nlargest allocation here: {} {}",
            human_bytes(block.size),
            block.what()
        );
    }
    text
}

/// Where things go: the columns, and the scales from changes to x and from bytes to y.
struct Layout<'t> {
    timeline: &'t Timeline,
    columns: Vec<Column>,
    /// Changes drawn (at least 1, so that an empty trace still has a scale).
    count: usize,
    /// The y axis's top, and the step between its grid lines.
    top_bytes: u64,
    step: u64,
}

impl<'t> Layout<'t> {
    fn new(timeline: &'t Timeline) -> Layout<'t> {
        let columns = columns(timeline, COLUMNS);
        let highest_reserved = columns.iter().map(|c| c.state.reserved).max().unwrap_or(0);
        let (top_bytes, step) = axis(highest_reserved.max(timeline.peak.state.allocated()));
        Layout {
            timeline,
            count: timeline.changes.len().max(1),
            columns,
            top_bytes,
            step,
        }
    }

    /// The x of change `index` (0..=count).
    fn x_of_change(&self, index: usize) -> i32 {
        let share = index.min(self.count) as f64 / self.count as f64;
        LEFT + (share * (RIGHT - LEFT) as f64).round() as i32
    }

    /// The x of the first change at or after `time_us`.
    fn x_of_time(&self, time_us: i64) -> i32 {
        self.x_of_change(
            self.timeline
                .changes
                .partition_point(|c| c.time_us < time_us),
        )
    }

    /// The left edge of column `i` (the right edge of the last one for `i` = their number).
    fn column_x(&self, i: usize) -> i32 {
        self.columns
            .get(i)
            .map_or(RIGHT, |column| self.x_of_change(column.changes.0))
    }

    fn y_of(&self, bytes: u64) -> i32 {
        let share = bytes as f64 / self.top_bytes.max(1) as f64;
        BOTTOM - (share * (BOTTOM - TOP) as f64).round() as i32
    }

    fn peak(&self) -> (i32, i32) {
        let peak = &self.timeline.peak;
        (
            self.x_of_change(peak.change.map_or(0, |c| c + 1)),
            self.y_of(peak.state.allocated()),
        )
    }

    /// The stacked categories that hold bytes somewhere.
    fn present(&self) -> Vec<CategoryName> {
        STACKED
            .iter()
            .enumerate()
            .filter(|(i, _)| {
                self.timeline.start.bytes[*i] > 0
                    || self.columns.iter().any(|c| c.state.bytes[*i] > 0)
            })
            .map(|(_, &c)| c)
            .collect()
    }

    fn phases(&self) -> Vec<Phase> {
        Phase::ALL
            .into_iter()
            .filter(|p| self.timeline.phases.iter().any(|b| b.phase == *p))
            .collect()
    }

    fn bands(&self, root: &Area) -> Result<(), String> {
        for band in &self.timeline.phases {
            let (x0, x1) = (self.x_of_time(band.start_us), self.x_of_time(band.end_us));
            if x1 > x0 {
                let colour = phase_colour(band.phase).filled();
                root.draw(&Rectangle::new([(x0, TOP), (x1, BOTTOM)], colour))
                    .map_err(failed)?;
            }
        }
        Ok(())
    }

    fn y_axis(&self, root: &Area) -> Result<(), String> {
        let mut bytes = 0;
        while bytes <= self.top_bytes {
            let y = self.y_of(bytes);
            let grid = PathElement::new([(LEFT - 4, y), (RIGHT, y)], RGBColor(225, 225, 225));
            root.draw(&grid).map_err(failed)?;
            let label = if bytes == 0 {
                "0".to_string()
            } else {
                human_bytes(bytes)
            };
            root.draw(&Text::new(label, (6, y - 7), font(TEXT_PX)))
                .map_err(failed)?;
            bytes += self.step.max(1);
        }
        Ok(())
    }

    /// One polygon per category, bottom to top, and the cache above allocated memory.
    fn areas(&self, root: &Area, present: &[CategoryName]) -> Result<(), String> {
        let mut below = vec![0u64; self.columns.len()];
        let mut layers: Vec<(RGBColor, Vec<u64>)> = Vec::new();
        for (i, category) in STACKED.iter().enumerate() {
            if present.contains(category) {
                let tops: Vec<u64> = self
                    .columns
                    .iter()
                    .zip(&below)
                    .map(|(c, b)| b + c.state.bytes[i])
                    .collect();
                layers.push((colour(*category), tops.clone()));
                below = tops;
            }
        }
        let reserved = self
            .columns
            .iter()
            .zip(&below)
            .map(|(c, b)| c.state.reserved.max(*b))
            .collect();
        layers.push((colour(CategoryName::Fragmentation), reserved));
        let mut floor = vec![0u64; self.columns.len()];
        for (colour, tops) in &layers {
            let mut points: Vec<(i32, i32)> = Vec::with_capacity(self.columns.len() * 4);
            for (i, top) in tops.iter().enumerate() {
                points.push((self.column_x(i), self.y_of(*top)));
                points.push((self.column_x(i + 1), self.y_of(*top)));
            }
            for (i, bottom) in floor.iter().enumerate().rev() {
                points.push((self.column_x(i + 1), self.y_of(*bottom)));
                points.push((self.column_x(i), self.y_of(*bottom)));
            }
            root.draw(&Polygon::new(points, colour.filled()))
                .map_err(failed)?;
            floor = tops.clone();
        }
        Ok(())
    }

    /// OOMs as red lines, the peak as a circle with its bytes.
    fn marks(&self, root: &Area) -> Result<(), String> {
        for oom in &self.timeline.ooms {
            let x = self.x_of_time(oom.time_us);
            root.draw(&PathElement::new(
                [(x, TOP), (x, BOTTOM)],
                RED.stroke_width(2),
            ))
            .map_err(failed)?;
        }
        let (x, y) = self.peak();
        root.draw(&Circle::new((x, y), 5, BLACK.stroke_width(2)))
            .map_err(failed)?;
        let label = format!("peak {}", human_bytes(self.timeline.peak.state.allocated()));
        let label_x = if x > RIGHT - 150 { x - 150 } else { x + 8 };
        root.draw(&Text::new(
            label,
            (label_x, (y - 20).max(TOP - 16)),
            font(TEXT_PX),
        ))
        .map_err(failed)?;
        Ok(())
    }

    /// The x axis: allocation events, with the time they span.
    fn x_axis(&self, root: &Area) -> Result<(), String> {
        for tick in 0..=4usize {
            let x = LEFT + (RIGHT - LEFT) * tick as i32 / 4;
            root.draw(&PathElement::new([(x, BOTTOM), (x, BOTTOM + 4)], BLACK))
                .map_err(failed)?;
            let label = format!("{}", self.timeline.changes.len() * tick / 4);
            let width = 8 * label.len() as i32;
            let at = (x - width / 2).min(WIDTH - 4 - width);
            root.draw(&Text::new(label, (at, BOTTOM + 6), font(TEXT_PX)))
                .map_err(failed)?;
        }
        let label = format!(
            "allocation events, in order ({:.1} ms in all; hover for times)",
            ms(self.timeline, self.timeline.end_us)
        );
        root.draw(&Text::new(label, (LEFT, BOTTOM + 24), font(TEXT_PX)))
            .map_err(failed)?;
        Ok(())
    }

    fn legend(&self, root: &Area, entries: &[(RGBColor, String)]) -> Result<(), String> {
        for (i, (swatch, label)) in entries.iter().enumerate() {
            let x = LEFT + (i % 2) as i32 * ((WIDTH - LEFT) / 2);
            let y = BOTTOM + 48 + (i / 2) as i32 * ROW;
            root.draw(&Rectangle::new([(x, y), (x + 14, y + 14)], swatch.filled()))
                .map_err(failed)?;
            root.draw(&Text::new(label.clone(), (x + 20, y), font(TEXT_PX)))
                .map_err(failed)?;
        }
        Ok(())
    }

    /// A rectangle per column and a circle on the peak, each with its hover text (the peak
    /// last: an SVG draws it on top).
    fn hovers(&self, sources: &CellSources) -> Vec<Hover> {
        let mut hovers: Vec<Hover> = self
            .columns
            .iter()
            .enumerate()
            .map(|(i, column)| Hover {
                spot: Spot::Rect {
                    x0: self.column_x(i),
                    y0: TOP,
                    x1: self.column_x(i + 1).max(self.column_x(i) + 1),
                    y1: BOTTOM,
                },
                text: column_title(self.timeline, column, sources),
            })
            .collect();
        let (x, y) = self.peak();
        hovers.push(Hover {
            spot: Spot::Circle { x, y, r: 9 },
            text: text(self.timeline, sources, "peak"),
        });
        hovers
    }
}

/// The SVG chart with its hover text as SVG `<title>`s (a chart saved as a file). The x axis
/// counts allocation events (see [`crate::timeline::series`]); times are in the hover text.
pub fn svg(timeline: &Timeline, sources: &CellSources, title: &str) -> Result<String, String> {
    let (mut svg, hovers) = drawn(timeline, sources, title)?;
    let end = svg.rfind("</svg>").ok_or("plotters wrote no </svg>")?;
    let mut layer = String::from("<g fill=\"#000\" fill-opacity=\"0\">");
    for hover in &hovers {
        layer.push_str(&hover.svg());
    }
    layer.push_str("</g>");
    svg.insert_str(end, &layer);
    Ok(svg)
}

/// The chart for a notebook: an image, its hover text in an image map (see
/// [`crate::report::embed`]).
pub fn html(timeline: &Timeline, sources: &CellSources, title: &str) -> Result<String, String> {
    let (svg, mut hovers) = drawn(timeline, sources, title)?;
    // Where areas overlap, a map takes the first: the peak goes first (an SVG draws it last).
    hovers.rotate_right(1);
    Ok(embed::image_with_hovers(&svg, title, &hovers))
}

/// The chart drawn, without hover text, and its hover text.
fn drawn(
    timeline: &Timeline,
    sources: &CellSources,
    title: &str,
) -> Result<(String, Vec<Hover>), String> {
    let layout = Layout::new(timeline);
    let present = layout.present();
    let mut legend: Vec<(RGBColor, String)> = present
        .iter()
        .map(|&c| (colour(c), c.label().to_string()))
        .collect();
    legend.push((
        colour(CategoryName::Fragmentation),
        "cache (reserved − allocated)".into(),
    ));
    legend.extend(
        layout
            .phases()
            .into_iter()
            .map(|p| (phase_colour(p), format!("phase: {}", p.label()))),
    );
    let height = (BOTTOM + 52 + legend.len().div_ceil(2) as i32 * ROW) as u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH as u32, height)).into_drawing_area();
        root.fill(&WHITE).map_err(failed)?;
        root.draw(&Text::new(title.to_string(), (10, 8), font(TITLE_PX)))
            .map_err(failed)?;
        layout.bands(&root)?;
        layout.y_axis(&root)?;
        layout.areas(&root, &present)?;
        layout.marks(&root)?;
        layout.x_axis(&root)?;
        layout.legend(&root, &legend)?;
        root.present().map_err(failed)?;
    }
    Ok((svg, layout.hovers(sources)))
}
