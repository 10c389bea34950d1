//! The allocation timeline under a `%%memprofile` cell: memory over time as stacked areas by
//! category with the cache above them, phase bands, the peak and OOMs marked, hover text on
//! every column and on the peak (SVG `<title>`s: no script, nothing fetched), and the same in
//! words.

use std::fmt::Write as _;

use plotters::prelude::*;
use tchmem_wire::memory::CategoryName;
use tchmem_wire::timeline::{Phase, TIMELINE_MIME};

use super::chart::{colour, font, TEXT_PX, TITLE_PX};
use super::format::human_bytes;
use crate::timeline::model::{State, Timeline, STACKED};
use crate::timeline::series::{columns, Column};
use crate::timeline::sites::CellSources;

/// Columns drawn (and hover targets): enough for a 640 px chart, few enough to stay small.
pub const COLUMNS: usize = 360;
/// Largest blocks listed at the peak.
const TOP_BLOCKS: usize = 8;

const WIDTH: i32 = 640;
const LEFT: i32 = 84;
const RIGHT: i32 = WIDTH - 12;
const TOP: i32 = 40;
const BOTTOM: i32 = 290;

fn phase_colour(phase: Phase) -> RGBColor {
    match phase {
        Phase::Data => RGBColor(225, 205, 235),
        Phase::Forward => RGBColor(253, 221, 200),
        Phase::Backward => RGBColor(205, 235, 210),
        Phase::Step => RGBColor(254, 240, 190),
        Phase::Other => RGBColor(240, 240, 240),
    }
}

fn ms(timeline: &Timeline, time_us: i64) -> f64 {
    (time_us - timeline.start_us) as f64 / 1000.0
}

/// The phase at `time_us`, if one was marked.
fn phase_at(timeline: &Timeline, time_us: i64) -> Option<Phase> {
    timeline
        .phases
        .iter()
        .find(|b| b.start_us <= time_us && time_us < b.end_us)
        .map(|b| b.phase)
}

/// Bytes by category, largest first, leaving out empty ones.
fn by_category(state: &State) -> Vec<(CategoryName, u64)> {
    let mut present: Vec<(CategoryName, u64)> = STACKED
        .iter()
        .zip(state.bytes)
        .filter(|(_, b)| *b > 0)
        .map(|(&c, b)| (c, b))
        .collect();
    present.sort_by_key(|&(_, b)| std::cmp::Reverse(b));
    present
}

fn categories_text(state: &State) -> String {
    by_category(state)
        .iter()
        .map(|(c, b)| format!("{} {}", c.label(), human_bytes(*b)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One largest block at the peak, for the text, the table and the hover.
pub struct PeakBlock {
    /// Bytes.
    pub size: u64,
    /// Category.
    pub category: CategoryName,
    /// Phase it was allocated in.
    pub phase: Phase,
    /// Where, when the stack is known.
    pub site: Option<String>,
}

/// The largest blocks alive at the peak.
pub fn peak_blocks(timeline: &Timeline, sources: &CellSources) -> Vec<PeakBlock> {
    timeline
        .peak
        .alive
        .iter()
        .take(TOP_BLOCKS)
        .map(|&b| {
            let block = &timeline.blocks[b];
            let frames = block
                .alloc_entry
                .map(|e| timeline.entries[e].frames.as_slice())
                .unwrap_or_default();
            PeakBlock {
                size: block.size,
                category: block.category,
                phase: block.phase,
                site: sources.site(frames),
            }
        })
        .collect()
}

/// Allocation sites at the peak with their bytes, largest first (stacks only).
pub fn peak_sites(timeline: &Timeline, sources: &CellSources) -> Vec<(String, u64, usize)> {
    let mut sites: std::collections::HashMap<String, (u64, usize)> = Default::default();
    for &b in &timeline.peak.alive {
        let block = &timeline.blocks[b];
        let Some(entry) = block.alloc_entry else {
            continue;
        };
        if let Some(site) = sources.site(&timeline.entries[entry].frames) {
            let slot = sites.entry(site).or_default();
            slot.0 += block.size;
            slot.1 += 1;
        }
    }
    let mut sites: Vec<(String, u64, usize)> =
        sites.into_iter().map(|(s, (b, n))| (s, b, n)).collect();
    sites.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    sites
}

/// The timeline in words: what was recorded, the peak, what was alive then.
pub fn text(timeline: &Timeline, sources: &CellSources, title: &str) -> String {
    let mut out = String::new();
    let span = ms(timeline, timeline.end_us);
    let _ = writeln!(
        out,
        "{title}: {} allocations and {} frees over {span:.1} ms{}",
        timeline.allocs,
        timeline.frees,
        if timeline.truncated {
            " (the ring was full: earlier entries were dropped; raise --max-entries)"
        } else {
            ""
        }
    );
    let peak = &timeline.peak;
    let phase = phase_at(timeline, peak.time_us)
        .map(|p| format!(" ({})", p.label()))
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "peak {} allocated at {:.1} ms{phase}, {} reserved: {}",
        human_bytes(peak.state.allocated()),
        ms(timeline, peak.time_us),
        human_bytes(peak.state.reserved),
        categories_text(&peak.state)
    );
    let blocks = peak_blocks(timeline, sources);
    if !blocks.is_empty() {
        let _ = writeln!(
            out,
            "largest blocks alive at the peak (of those allocated while recording):"
        );
        for block in &blocks {
            let _ = writeln!(
                out,
                "  {:>10}  {} ({}){}",
                human_bytes(block.size),
                block.category.label(),
                match block.phase {
                    Phase::Other => "made outside the marked phases".to_string(),
                    phase => format!("made in {}", phase.label()),
                },
                block
                    .site
                    .as_ref()
                    .map(|s| format!("  {s}"))
                    .unwrap_or_default()
            );
        }
    }
    for oom in &timeline.ooms {
        let _ = writeln!(
            out,
            "out of memory at {:.1} ms: a request for {} with {} free on the device",
            ms(timeline, oom.time_us),
            human_bytes(oom.requested),
            human_bytes(oom.device_free)
        );
    }
    out
}

fn escape(text: &str) -> String {
    super::escape(text)
}

/// The hover text of one column.
fn column_title(timeline: &Timeline, column: &Column) -> String {
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
    text
}

/// The y of `bytes` on a scale whose top is `highest`.
fn y_of(bytes: u64, highest: u64) -> i32 {
    BOTTOM - ((bytes as f64 / highest as f64) * (BOTTOM - TOP) as f64).round() as i32
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

/// The SVG chart (hover text included). The x axis counts allocation events (see
/// [`crate::timeline::series`]); times are in the hover text.
pub fn svg(timeline: &Timeline, sources: &CellSources, title: &str) -> Result<String, String> {
    let cols = columns(timeline, COLUMNS);
    let count = timeline.changes.len().max(1);
    let highest_reserved = cols.iter().map(|c| c.state.reserved).max().unwrap_or(0);
    let (top_bytes, step) = axis(highest_reserved.max(timeline.peak.state.allocated()).max(1));
    let present: Vec<CategoryName> = STACKED
        .iter()
        .enumerate()
        .filter(|(i, _)| cols.iter().any(|c| c.state.bytes[*i] > 0) || timeline.start.bytes[*i] > 0)
        .map(|(_, &c)| c)
        .collect();
    let phases_present: Vec<Phase> = Phase::ALL
        .into_iter()
        .filter(|p| timeline.phases.iter().any(|b| b.phase == *p))
        .collect();
    let legend_entries = present.len() + 1 + phases_present.len();
    let legend_rows = legend_entries.div_ceil(2) as i32;
    let height = (BOTTOM + 52 + legend_rows * 22) as u32;
    // Change `index` (0..=count) → x.
    let x_of_change = |index: usize| {
        LEFT + ((index.min(count) as f64 / count as f64) * (RIGHT - LEFT) as f64).round() as i32
    };
    // A time → the x of the first change at or after it.
    let x_of =
        |time_us: i64| x_of_change(timeline.changes.partition_point(|c| c.time_us < time_us));
    let column_x = |i: usize| match cols.get(i) {
        Some(column) => x_of_change(column.changes.0),
        None => RIGHT,
    };
    let peak_x = x_of_change(timeline.peak.change.map_or(0, |c| c + 1));
    let peak_y = y_of(timeline.peak.state.allocated(), top_bytes);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH as u32, height)).into_drawing_area();
        let e = |e: DrawingAreaErrorKind<std::io::Error>| e.to_string();
        root.fill(&WHITE).map_err(e)?;
        root.draw(&Text::new(title.to_string(), (10, 8), font(TITLE_PX)))
            .map_err(e)?;
        // Phase bands behind everything.
        for band in &timeline.phases {
            let (x0, x1) = (x_of(band.start_us), x_of(band.end_us));
            if x1 > x0 {
                let colour = phase_colour(band.phase).filled();
                root.draw(&Rectangle::new([(x0, TOP), (x1, BOTTOM)], colour))
                    .map_err(e)?;
            }
        }
        // The y axis.
        let text = font(TEXT_PX);
        let mut bytes = 0;
        while bytes <= top_bytes {
            let y = y_of(bytes, top_bytes);
            let grid = PathElement::new([(LEFT - 4, y), (RIGHT, y)], RGBColor(225, 225, 225));
            root.draw(&grid).map_err(e)?;
            let label = if bytes == 0 {
                "0".to_string()
            } else {
                human_bytes(bytes)
            };
            root.draw(&Text::new(label, (6, y - 7), text.clone()))
                .map_err(e)?;
            bytes += step.max(1);
        }
        // Stacked areas, one polygon per category, bottom to top; the cache above allocated.
        let mut below = vec![0u64; cols.len()];
        let mut layers: Vec<(RGBColor, Vec<u64>)> = Vec::new();
        for (i, &category) in STACKED.iter().enumerate() {
            if !present.contains(&category) {
                continue;
            }
            let tops: Vec<u64> = cols
                .iter()
                .zip(&below)
                .map(|(c, b)| b + c.state.bytes[i])
                .collect();
            layers.push((colour(category), tops.clone()));
            below = tops;
        }
        let reserved: Vec<u64> = cols
            .iter()
            .zip(&below)
            .map(|(c, b)| c.state.reserved.max(*b))
            .collect();
        layers.push((colour(CategoryName::Fragmentation), reserved));
        let mut floor = vec![0u64; cols.len()];
        for (colour, tops) in &layers {
            let mut points: Vec<(i32, i32)> = Vec::with_capacity(cols.len() * 4);
            for (i, top) in tops.iter().enumerate() {
                points.push((column_x(i), y_of(*top, top_bytes)));
                points.push((column_x(i + 1), y_of(*top, top_bytes)));
            }
            for (i, bottom) in floor.iter().enumerate().rev() {
                points.push((column_x(i + 1), y_of(*bottom, top_bytes)));
                points.push((column_x(i), y_of(*bottom, top_bytes)));
            }
            root.draw(&Polygon::new(points, colour.filled()))
                .map_err(e)?;
            floor = tops.clone();
        }
        // OOMs: red lines.
        for oom in &timeline.ooms {
            let x = x_of(oom.time_us);
            root.draw(&PathElement::new(
                [(x, TOP), (x, BOTTOM)],
                RED.stroke_width(2),
            ))
            .map_err(e)?;
        }
        // The peak.
        root.draw(&Circle::new((peak_x, peak_y), 5, BLACK.stroke_width(2)))
            .map_err(e)?;
        let label = format!("peak {}", human_bytes(timeline.peak.state.allocated()));
        let label_x = if peak_x > RIGHT - 150 {
            peak_x - 150
        } else {
            peak_x + 8
        };
        root.draw(&Text::new(
            label,
            (label_x, (peak_y - 20).max(TOP - 16)),
            text.clone(),
        ))
        .map_err(e)?;
        // The x axis: allocation events.
        for tick in 0..=4usize {
            let x = LEFT + (RIGHT - LEFT) * tick as i32 / 4;
            root.draw(&PathElement::new([(x, BOTTOM), (x, BOTTOM + 4)], BLACK))
                .map_err(e)?;
            let label = format!("{}", timeline.changes.len() * tick / 4);
            let width = 8 * label.len() as i32;
            let at = (x - width / 2).min(WIDTH - 4 - width);
            root.draw(&Text::new(label, (at, BOTTOM + 6), text.clone()))
                .map_err(e)?;
        }
        let axis_label = format!(
            "allocation events, in order ({:.1} ms in all; hover for times)",
            ms(timeline, timeline.end_us)
        );
        root.draw(&Text::new(axis_label, (LEFT, BOTTOM + 24), text.clone()))
            .map_err(e)?;
        // The legend.
        let mut entries: Vec<(RGBColor, String)> = present
            .iter()
            .map(|&c| (colour(c), c.label().to_string()))
            .collect();
        entries.push((
            colour(CategoryName::Fragmentation),
            "cache (reserved − allocated)".into(),
        ));
        entries.extend(
            phases_present
                .iter()
                .map(|&p| (phase_colour(p), format!("phase: {}", p.label()))),
        );
        for (i, (swatch, label)) in entries.iter().enumerate() {
            let x = LEFT + (i % 2) as i32 * ((WIDTH - LEFT) / 2);
            let y = BOTTOM + 48 + (i / 2) as i32 * 22;
            root.draw(&Rectangle::new([(x, y), (x + 14, y + 14)], swatch.filled()))
                .map_err(e)?;
            root.draw(&Text::new(label.clone(), (x + 20, y), text.clone()))
                .map_err(e)?;
        }
        root.present().map_err(e)?;
    }
    // Hover targets: a transparent rectangle per column, and the peak's circle.
    let mut hovers = String::from("<g fill=\"#000\" fill-opacity=\"0\">");
    for (i, column) in cols.iter().enumerate() {
        let (x0, x1) = (column_x(i), column_x(i + 1).max(column_x(i) + 1));
        let _ = write!(
            hovers,
            "<rect x=\"{x0}\" y=\"{TOP}\" width=\"{}\" height=\"{}\"><title>{}</title></rect>",
            x1 - x0,
            BOTTOM - TOP,
            escape(&column_title(timeline, column))
        );
    }
    let _ = write!(
        hovers,
        "<circle cx=\"{peak_x}\" cy=\"{peak_y}\" r=\"9\"><title>{}</title></circle></g>",
        escape(&text(timeline, sources, "peak"))
    );
    let end = svg.rfind("</svg>").ok_or("plotters wrote no </svg>")?;
    svg.insert_str(end, &hovers);
    Ok(svg)
}

/// An HTML table of the allocation sites alive at the peak (with stacks).
pub fn sites_table(timeline: &Timeline, sources: &CellSources) -> Option<String> {
    let sites = peak_sites(timeline, sources);
    if sites.is_empty() {
        return None;
    }
    let mut html = String::from(
        "<table><thead><tr><th style=\"text-align:left\">allocated at (alive at the peak)</th>\
         <th>bytes</th><th>blocks</th></tr></thead><tbody>",
    );
    for (site, bytes, count) in sites.iter().take(10) {
        let _ = write!(
            html,
            "<tr><td style=\"text-align:left\"><code>{}</code></td><td>{}</td><td>{count}</td></tr>",
            escape(site),
            human_bytes(*bytes)
        );
    }
    html.push_str("</tbody></table>");
    Some(html)
}

/// The display under a profiled cell: words, the chart and the sites table, and the capture.
pub fn display(
    timeline: &Timeline,
    capture: &tchmem_wire::timeline::TimelineCapture,
    sources: &CellSources,
    title: &str,
) -> tchmem_wire::Display {
    use serde_json::Value;
    let words = text(timeline, sources, title);
    let chart = svg(timeline, sources, title).unwrap_or_else(|e| format!("<!-- chart: {e} -->"));
    let mut html = format!("<div class=\"tchmem-timeline\">{chart}");
    if let Some(table) = sites_table(timeline, sources) {
        html.push_str(&table);
    }
    let _ = write!(
        html,
        "<pre>{}</pre><p>Snapshot for PyTorch's memory_viz: <code>{}</code> \
         (<code>%memsnapshot PATH.pickle</code> copies it)</p></div>",
        escape(&words),
        escape(&capture.snapshot)
    );
    let mut data = serde_json::Map::new();
    data.insert("text/plain".into(), Value::String(words));
    data.insert("text/html".into(), Value::String(html));
    data.insert(
        TIMELINE_MIME.into(),
        serde_json::to_value(capture).unwrap_or_default(),
    );
    tchmem_wire::Display {
        data,
        ..Default::default()
    }
}
