//! How memory records are shown: one line of text, an HTML table with an SVG chart, and the
//! record itself as JSON (`application/vnd.tchmem.record+json`) for tools.

mod chart;
pub mod compare;
pub mod distributed;
pub mod embed;
pub mod fit;
pub mod format;
pub mod live;
pub mod timeline;

use serde_json::{Map, Value};
use tchmem_wire::memory::MemoryRecord;
use tchmem_wire::mime::RECORD_MIME;
use tchmem_wire::Display;

use format::{human_bytes, signed_bytes};

/// Text as HTML content, as every room of the report writes it.
pub(crate) use crate::html::text as escape;

/// The chart of a record's categories as a standalone SVG document; the title defaults to
/// "<device> after the cell".
pub fn chart_svg(record: &MemoryRecord, title: Option<&str>) -> Result<String, String> {
    let title = title.map_or_else(
        || format!("{} after the cell", record.device),
        str::to_string,
    );
    chart::stacked_bar(&title, &record.categories)
}

/// Whether a cell changed memory enough to be worth showing in `auto` mode.
pub fn changed(record: &MemoryRecord, previous: Option<&MemoryRecord>) -> bool {
    if let Some(cuda) = &record.cuda {
        return cuda.before.allocated != cuda.after.allocated
            || cuda.before.reserved != cuda.after.reserved
            || cuda.peak.allocated > cuda.before.allocated.max(cuda.after.allocated);
    }
    match previous {
        Some(previous) => previous.categories != record.categories,
        None => record.categories.iter().any(|c| c.bytes > 0),
    }
}

/// The compact line shown after a cell.
pub fn one_line(record: &MemoryRecord) -> String {
    let categories: Vec<String> = record
        .categories
        .iter()
        .filter(|c| c.bytes > 0)
        .map(|c| format!("{} {}", c.name.label(), human_bytes(c.bytes)))
        .collect();
    let mut categories = if categories.is_empty() {
        "no watched tensors (tchmem::watch(&vs))".to_string()
    } else {
        categories.join(", ")
    };
    if let Some(activations) = record.at_backward.as_ref().and_then(|at| {
        at.iter()
            .find(|c| c.name == tchmem_wire::memory::CategoryName::Activations)
    }) {
        categories.push_str(&format!(
            "; activations at backward {}",
            human_bytes(activations.bytes)
        ));
    }
    match &record.cuda {
        Some(cuda) => format!(
            "{}: allocated {} ({}), peak {}, reserved {} | {categories}",
            record.device,
            human_bytes(cuda.after.allocated),
            signed_bytes(cuda.after.allocated as i128 - cuda.before.allocated as i128),
            human_bytes(cuda.peak.allocated),
            human_bytes(cuda.after.reserved),
        ),
        None => format!(
            "{}: {categories} (allocator counters are CUDA-only)",
            record.device
        ),
    }
}

/// What expandable segments did to the cache on the GPT benchmark on the H200
/// (results/gpu/2026-12-01-estimate-fit/expandable-segments.txt).
pub const EXPANDABLE_SEGMENTS_MEASURED: &str = "on the GPT benchmark on the H200 the cache at the \
     peak went from 1.5 GiB to 93 MiB (plain) and from 660 MiB to 62 MiB (--accumulate 4)";

/// A cache worth a word: at least this much reserved but not allocated, and half of reserved.
const LARGE_CACHE: u64 = 1 << 30;

/// Advice when the allocator holds much more than its tensors need: the cache can be given
/// back (`%memfree`) and kept smaller (expandable segments).
pub fn cache_advice(record: &MemoryRecord) -> Option<String> {
    let cuda = record.cuda.as_ref()?;
    let cache = cuda.after.reserved.saturating_sub(cuda.after.allocated);
    (cache >= LARGE_CACHE && cache * 2 >= cuda.after.reserved).then(|| {
        format!(
            "{} is reserved but not allocated (the allocator's cache and fragments): `%memfree` \
             gives it back to the device; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in \
             the kernel's environment keeps less of it ({EXPANDABLE_SEGMENTS_MEASURED}).",
            human_bytes(cache)
        )
    })
}

/// The display shown after a cell: text, HTML with the chart and a table, and the JSON record.
pub fn cell_display(record: &MemoryRecord) -> Display {
    let mut data = Map::new();
    let advice = cache_advice(record);
    let text = match &advice {
        Some(advice) => format!("{}\n{advice}", one_line(record)),
        None => one_line(record),
    };
    data.insert("text/plain".into(), Value::String(text));
    let title = format!("{} after the cell", record.device);
    let mut chart = embed::chart_html(chart_svg(record, Some(&title)), &title);
    if let Some(advice) = &advice {
        chart.push_str(&format!("<div>{}</div>", escape(advice)));
    }
    if let Some(at_backward) = &record.at_backward {
        let title = format!(
            "{} at the start of backward (peak of the step)",
            record.device
        );
        chart.push_str(&embed::chart_html(
            chart::stacked_bar(&title, at_backward),
            &title,
        ));
    }
    data.insert("text/html".into(), Value::String(html(record, &chart)));
    data.insert(
        RECORD_MIME.into(),
        serde_json::to_value(record).unwrap_or_default(),
    );
    Display {
        data,
        ..Default::default()
    }
}

/// How far NVML's view of the process is explained by the context measured at start plus the
/// allocator's reserved bytes.
pub fn reconciliation(record: &MemoryRecord) -> Option<String> {
    let cuda = record.cuda.as_ref()?;
    let (gap, fraction) = cuda.unexplained()?;
    Some(format!(
        "NVML process usage {} = context at start {} + reserved {} {} {} unexplained ({:+.1}% of \
         NVML: kernels loaded since start, library workspaces)",
        human_bytes(cuda.nvml_process?),
        human_bytes(cuda.context_at_start?),
        human_bytes(cuda.after.reserved),
        if gap < 0 { "−" } else { "+" },
        human_bytes(gap.unsigned_abs()),
        fraction * 100.0
    ))
}

fn html(record: &MemoryRecord, chart: &str) -> String {
    let mut rows = String::new();
    for category in &record.categories {
        rows.push_str(&format!(
            "<tr><td>{}</td><td style='text-align:right'>{}</td><td>{}</td><td>{}</td></tr>",
            category.name.label(),
            human_bytes(category.bytes),
            if category.exact { "exact" } else { "inferred" },
            escape(&category.how),
        ));
    }
    let notes: String = record
        .notes
        .iter()
        .cloned()
        .chain(reconciliation(record))
        .map(|n| format!("<li>{}</li>", escape(&n)))
        .collect();
    format!(
        "<div class='tchmem-memory'><div>{}</div>{chart}<details><summary>categories</summary>\
         <table><tr><th>category</th><th>bytes</th><th></th><th>how</th></tr>{rows}</table>\
         <ul>{notes}</ul></details></div>",
        escape(&one_line(record))
    )
}

/// A record's bytes (allocated on CUDA; the watched tensors' on CPU), the cell's change of them,
/// the peak and the reserved bytes, as shown in tables ("-" where the record has none).
pub(crate) fn counters(record: &MemoryRecord) -> [String; 4] {
    match &record.cuda {
        Some(c) => [
            human_bytes(c.after.allocated),
            signed_bytes(c.after.allocated as i128 - c.before.allocated as i128),
            human_bytes(c.peak.allocated),
            human_bytes(c.after.reserved),
        ],
        None => {
            let known: u64 = record.categories.iter().map(|c| c.bytes).sum();
            [human_bytes(known), "-".into(), "-".into(), "-".into()]
        }
    }
}

/// Numbered records as a table, text and HTML rows (the header row first): `column` names the
/// numbers (a run, a rank).
pub(crate) fn records_table(column: &str, records: &[(usize, MemoryRecord)]) -> (String, String) {
    let mut text = format!("{column:<4} device   bytes      change     peak       reserved\n");
    let mut rows = format!(
        "<tr><th>{column}</th><th>device</th>\
         <th title='allocated on CUDA; watched tensors on CPU'>bytes</th><th>change</th>\
         <th>peak</th><th>reserved</th></tr>"
    );
    for (number, record) in records {
        let [allocated, change, peak, reserved] = counters(record);
        text.push_str(&format!(
            "{number:<4} {:<8} {allocated:<10} {change:<10} {peak:<10} {reserved}\n",
            record.device
        ));
        rows.push_str(&format!(
            "<tr><td>{number}</td><td>{}</td><td>{allocated}</td><td>{change}</td>\
             <td>{peak}</td><td>{reserved}</td></tr>",
            record.device
        ));
    }
    (text, rows)
}

/// The history of all cells' records as a table (`%memhistory`).
pub fn history_display(records: &[(usize, MemoryRecord)]) -> Display {
    let (mut text, rows) = records_table("run", records);
    if records.is_empty() {
        text = "no memory records yet (they need tch in the kernel)".into();
    }
    let columns: Vec<(usize, &[tchmem_wire::memory::Category])> = records
        .iter()
        .map(|(run, record)| (*run, record.categories.as_slice()))
        .collect();
    let chart = if records.is_empty() {
        String::new()
    } else {
        embed::chart_html(chart::history_columns(&columns), "memory by run")
    };
    let mut data = Map::new();
    data.insert("text/plain".into(), Value::String(text));
    data.insert(
        "text/html".into(),
        Value::String(format!("{chart}<table>{rows}</table>")),
    );
    Display {
        data,
        ..Default::default()
    }
}

/// The allocator's counters after run `run` as a table (`%memsummary`).
pub fn summary_display(last: Option<(usize, &MemoryRecord)>) -> Display {
    let mut rows: Vec<(String, String)> = Vec::new();
    let heading = match last {
        None => "no memory records yet (they need tch in the kernel)".to_string(),
        Some((run, record)) => {
            match &record.cuda {
                Some(cuda) => {
                    let counters = [
                        ("allocated", cuda.after.allocated, cuda.peak.allocated),
                        ("reserved", cuda.after.reserved, cuda.peak.reserved),
                        ("active", cuda.after.active, cuda.peak.active),
                        ("requested", cuda.after.requested, cuda.peak.requested),
                    ];
                    for (name, now, peak) in counters {
                        rows.push((
                            format!("{name} (now / peak in run {run})"),
                            format!("{} / {}", human_bytes(now), human_bytes(peak)),
                        ));
                    }
                    rows.push((
                        "fragmentation + cache (reserved − allocated)".into(),
                        human_bytes(cuda.after.reserved.saturating_sub(cuda.after.allocated)),
                    ));
                    rows.push((
                        "allocations in the run".into(),
                        cuda.allocations.to_string(),
                    ));
                    rows.push((
                        "alloc retries / OOMs in the run".into(),
                        format!("{} / {}", cuda.alloc_retries, cuda.ooms),
                    ));
                    rows.push((
                        "device free / total".into(),
                        format!(
                            "{} / {}",
                            human_bytes(cuda.device_free),
                            human_bytes(cuda.device_total)
                        ),
                    ));
                    rows.push((
                        "this process (NVML)".into(),
                        cuda.nvml_process.map_or("unavailable".into(), human_bytes),
                    ));
                    if let Some(text) = reconciliation(record) {
                        rows.push(("NVML reconciled".into(), text));
                    }
                }
                None => rows.push((
                    "allocator counters".into(),
                    "CUDA-only: this kernel's libtorch has no CUDA device".into(),
                )),
            }
            for category in &record.categories {
                rows.push((
                    category.name.label().to_string(),
                    human_bytes(category.bytes),
                ));
            }
            if let Some(seconds) = record.wall_seconds {
                rows.push(("cell ran for".into(), format!("{:.3} s", seconds)));
            }
            if let Some(seconds) = record.recording_seconds {
                rows.push((
                    "recording took".into(),
                    format!("{:.3} ms", seconds * 1000.0),
                ));
            }
            format!("{} after run {run}", record.device)
        }
    };
    let width = rows
        .iter()
        .map(|(k, _)| k.chars().count())
        .max()
        .unwrap_or(0);
    let mut text = heading.clone();
    let mut html = format!("<div><b>{}</b><table>", escape(&heading));
    for (key, value) in &rows {
        text.push_str(&format!("\n{key:<width$}  {value}"));
        html.push_str(&format!(
            "<tr><td>{}</td><td style='text-align:right'>{}</td></tr>",
            escape(key),
            escape(value)
        ));
    }
    html.push_str("</table></div>");
    let mut data = Map::new();
    data.insert("text/plain".into(), Value::String(text));
    data.insert("text/html".into(), Value::String(html));
    Display {
        data,
        ..Default::default()
    }
}

/// A display of plain text only.
pub fn text_display(text: String) -> Display {
    let mut data = Map::new();
    data.insert("text/plain".into(), Value::String(text));
    Display {
        data,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tchmem_wire::memory::{Category, CategoryName, Counters, CudaMemory};

    fn gpu_record() -> MemoryRecord {
        let mib = 1024 * 1024;
        let category = |name, bytes, exact| Category {
            name,
            bytes,
            exact,
            how: "test".into(),
        };
        MemoryRecord {
            device: "cuda:0".into(),
            cuda: Some(CudaMemory {
                before: Counters::default(),
                after: Counters {
                    allocated: 1536 * mib,
                    reserved: 2048 * mib,
                    ..Default::default()
                },
                peak: Counters {
                    allocated: 1800 * mib,
                    ..Default::default()
                },
                ..Default::default()
            }),
            at_backward: None,
            categories: vec![
                category(CategoryName::Parameters, 384 * mib, true),
                category(CategoryName::Gradients, 384 * mib, true),
                category(CategoryName::OptimizerState, 768 * mib, false),
                category(CategoryName::Activations, 0, false),
                category(CategoryName::InputBatch, mib, true),
                category(CategoryName::Fragmentation, 512 * mib, true),
                category(CategoryName::CudaContext, 800 * mib, false),
            ],
            notes: vec![],
            recording_seconds: None,
            wall_seconds: None,
        }
    }

    #[test]
    fn chart_is_svg_with_every_non_empty_category_labelled() {
        let svg = chart_svg(&gpu_record(), None).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        // The record's activations are 0 B: left out, as the summary line leaves them out.
        assert!(!svg.contains("activations"), "{svg}");
        for name in [
            "parameters",
            "gradients",
            "optimizer state",
            "input batch",
            "fragmentation + cache",
            "CUDA context + workspace",
        ] {
            assert!(svg.contains(name), "{name} missing from the chart");
        }
    }

    #[test]
    fn history_chart_has_a_column_per_run() {
        let record = gpu_record();
        let records = vec![(1, record.clone()), (2, record)];
        let display = history_display(&records);
        let html = display.data["text/html"].as_str().unwrap();
        let charts = embed::svgs_in(html);
        assert!(
            charts.len() == 1 && charts[0].contains("stacked by category"),
            "{html}"
        );
    }

    #[test]
    fn one_line_says_allocated_change_and_peak() {
        let line = one_line(&gpu_record());
        assert!(
            line.starts_with("cuda:0: allocated 1.5 GiB (+1.5 GiB), peak 1.8 GiB"),
            "{line}"
        );
        assert!(line.contains("parameters 384.0 MiB"));
    }

    #[test]
    fn summary_lists_counters_on_cuda_and_says_so_on_cpu() {
        let record = gpu_record();
        let text = summary_display(Some((3, &record))).data["text/plain"].to_string();
        assert!(text.contains("cuda:0 after run 3"), "{text}");
        assert!(text.contains("allocated (now / peak in run 3)"), "{text}");
        assert!(text.contains("1.5 GiB / 1.8 GiB"), "{text}");
        let cpu = MemoryRecord {
            device: "cpu".into(),
            ..Default::default()
        };
        let text = summary_display(Some((1, &cpu))).data["text/plain"].to_string();
        assert!(text.contains("CUDA-only"), "{text}");
    }

    #[test]
    fn auto_mode_shows_only_changes() {
        let record = gpu_record();
        assert!(changed(&record, None));
        let mut idle = record.clone();
        let cuda = idle.cuda.as_mut().unwrap();
        cuda.before = cuda.after;
        cuda.peak = cuda.after;
        assert!(!changed(&idle, Some(&record)));
    }

    #[test]
    fn a_large_cache_gets_advice_and_a_small_one_none() {
        let gib = 1u64 << 30;
        let with = |allocated, reserved| MemoryRecord {
            cuda: Some(CudaMemory {
                after: Counters {
                    allocated,
                    reserved,
                    ..Default::default()
                },
                ..Default::default()
            }),
            ..Default::default()
        };
        let advice = cache_advice(&with(gib, 4 * gib)).unwrap();
        assert!(
            advice.starts_with("3.0 GiB is reserved but not allocated"),
            "{advice}"
        );
        assert!(advice.contains("%memfree") && advice.contains("expandable_segments:True"));
        let display = cell_display(&with(gib, 4 * gib));
        assert!(display.data["text/plain"]
            .as_str()
            .unwrap()
            .contains("%memfree"));
        assert_eq!(cache_advice(&with(30 * gib, 31 * gib)), None);
        assert_eq!(cache_advice(&with(0, gib / 2)), None);
        assert_eq!(cache_advice(&MemoryRecord::default()), None);
    }
}
