//! The allocation timeline under a `%%memprofile` cell: the chart (`chart`), the same in words,
//! the allocation sites at the peak, and the display that holds them.

mod chart;

use std::fmt::Write as _;

use tchmem_wire::memory::CategoryName;
use tchmem_wire::timeline::{Phase, TIMELINE_MIME};

use super::escape;
use super::format::human_bytes;
use crate::timeline::model::{State, Timeline, STACKED};
use crate::timeline::sites::CellSources;

/// Largest blocks listed at the peak.
const TOP_BLOCKS: usize = 8;

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

impl PeakBlock {
    /// Block `b` of the timeline.
    pub fn of(timeline: &Timeline, b: usize, sources: &CellSources) -> PeakBlock {
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
    }

    /// "activations (made in forward)  cell [7], line 13: …": all but the size.
    pub fn what(&self) -> String {
        format!(
            "{} ({}){}",
            self.category.label(),
            match self.phase {
                Phase::Other => "made outside the marked phases".to_string(),
                phase => format!("made in {}", phase.label()),
            },
            self.site
                .as_ref()
                .map(|s| format!("  {s}"))
                .unwrap_or_default()
        )
    }
}

/// The largest blocks alive at the peak.
pub fn peak_blocks(timeline: &Timeline, sources: &CellSources) -> Vec<PeakBlock> {
    timeline
        .peak
        .alive
        .iter()
        .take(TOP_BLOCKS)
        .map(|&b| PeakBlock::of(timeline, b, sources))
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
            let _ = writeln!(out, "  {:>10}  {}", human_bytes(block.size), block.what());
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

pub use chart::svg;

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
    let chart = chart::html(timeline, sources, title)
        .unwrap_or_else(|why| crate::report::embed::no_chart(&why));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::model::build;
    use crate::timeline::snapshot::{Snapshot, TraceEntry};
    use tchmem_wire::timeline::{PhaseMark, TimelineCapture};

    const MIB: u64 = 1 << 20;

    fn entry(action: &str, addr: u64, size: u64, time_us: i64) -> TraceEntry {
        TraceEntry {
            action: action.into(),
            addr,
            size,
            time_us,
            ..Default::default()
        }
    }

    /// A forward pass that keeps two blocks, an allocation that fails, and a backward pass that
    /// frees them.
    fn failing_step() -> Timeline {
        let trace = vec![
            entry("segment_alloc", 0x1000, 256 * MIB, 10),
            entry("alloc", 0x1000, 64 * MIB, 11),
            entry("alloc", 0x2000, 128 * MIB, 12),
            entry("oom", 3 * MIB, 512 * MIB, 13),
            entry("free_completed", 0x2000, 128 * MIB, 21),
            entry("free_completed", 0x1000, 64 * MIB, 22),
        ];
        let capture = TimelineCapture {
            started_us: 5,
            ended_us: 30,
            phases: vec![
                PhaseMark {
                    phase: Phase::Forward,
                    time_us: 10,
                },
                PhaseMark {
                    phase: Phase::Backward,
                    time_us: 20,
                },
            ],
            ..Default::default()
        };
        build(
            Snapshot {
                device_traces: vec![trace],
            },
            &capture,
        )
    }

    #[test]
    fn an_out_of_memory_event_is_drawn_and_told_with_the_request_and_what_was_free() {
        let timeline = failing_step();
        let words = text(&timeline, &CellSources::default(), "t");
        assert!(words.contains("2 allocations and 2 frees"), "{words}");
        assert!(
            words.contains("a request for 512.0 MiB with 3.0 MiB free on the device"),
            "{words}"
        );
        assert!(words.contains("peak 192.0 MiB allocated"), "{words}");
        assert!(words.contains("activations 192.0 MiB"), "{words}");
        let svg = svg(&timeline, &CellSources::default(), "t").unwrap();
        assert!(svg.contains("#FF0000"), "the OOM's red line");
        assert!(svg.contains("phase: forward") && svg.contains("phase: backward"));
        assert!(
            svg.contains("largest allocation here: 128.0 MiB activations (made in forward)"),
            "a column's hover names its largest block"
        );
    }

    #[test]
    fn a_notebook_gets_the_chart_as_an_image_its_hover_text_in_a_map_the_peak_first() {
        let timeline = failing_step();
        let sources = CellSources::default();
        let html = chart::html(&timeline, &sources, "t").unwrap();
        let name = html
            .split("usemap=\"#")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .unwrap();
        let map = html
            .split(&format!("<map name=\"{name}\">"))
            .nth(1)
            .unwrap();
        assert!(map.starts_with("<area shape=\"circle\""), "{map}");
        assert!(map.contains("largest allocation here: 128.0 MiB activations (made in forward)"));
        // As many areas as the saved chart has hover titles.
        let saved = svg(&timeline, &sources, "t").unwrap();
        assert_eq!(
            map.matches("<area ").count(),
            saved.matches("<title>").count()
        );
        // The drawing itself has no hover layer: its text is in the map only.
        let drawn = &crate::report::embed::svgs_in(&html)[0];
        assert!(
            !drawn.contains("<title>") && !html.contains("<svg"),
            "{drawn}"
        );
    }

    #[test]
    fn an_empty_trace_still_draws_and_says_so() {
        let timeline = build(Snapshot::default(), &TimelineCapture::default());
        let words = text(&timeline, &CellSources::default(), "t");
        assert!(words.contains("0 allocations and 0 frees"), "{words}");
        assert!(svg(&timeline, &CellSources::default(), "t").is_ok());
    }
}
