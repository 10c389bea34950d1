//! `%%optimize --compare`: the original and the rewritten loop side by side (HTML table, loss
//! curves and peak bars as SVG, text fallback, both runs as JSON).

use plotters::prelude::*;
use serde_json::{Map, Value};
use tchmem_wire::compare::CompareRun;
use tchmem_wire::mime::COMPARISON_MIME;
use tchmem_wire::Display;

use crate::cell_error::ErrorName;

use super::chart::{font, TEXT_PX, TITLE_PX};
use super::embed;
use super::escape;
use super::format::human_bytes;

/// One side of the comparison: its run, or why it has none (e.g. the original ran out of memory).
pub type Side = Result<CompareRun, SideFailure>;

/// Why one side has no run: the cell error's name (`OutOfMemory`, `Panic`, …) kept apart from
/// its message, so that the table can show the name and the verdict the whole reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SideFailure {
    /// The error's name, as the cell error has it.
    pub name: ErrorName,
    /// Its first line of explanation.
    pub message: String,
}

impl SideFailure {
    /// A failure named `name`, explained by `message`.
    pub fn new(name: ErrorName, message: impl Into<String>) -> SideFailure {
        SideFailure {
            name,
            message: message.into(),
        }
    }

    /// Whether memory ran out (a result worth showing, not a failure of the comparison).
    pub fn is_out_of_memory(&self) -> bool {
        self.name == ErrorName::OutOfMemory
    }
}

impl std::fmt::Display for SideFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.name, self.message)
    }
}

/// Peak minus what outlives a step: activations and temporaries at the peak.
fn transient(run: &CompareRun) -> Option<u64> {
    Some(
        run.peak_allocated?
            .saturating_sub(run.allocated_after_step?),
    )
}

fn bytes_or(value: Option<u64>, missing: &str) -> String {
    value.map_or(missing.to_string(), human_bytes)
}

/// Rows of (what, original, rewritten).
fn rows(original: &Side, rewritten: &Side) -> Vec<(String, String, String)> {
    // One row: `show` applied to each side that ran.
    let row = |what: &str, show: &dyn Fn(&CompareRun) -> String| {
        let cell = |side: &Side| match side {
            Ok(run) => show(run),
            // The error's name; the verdict under the table gives the whole reason once.
            Err(why) => format!("failed: {}", why.name),
        };
        (what.to_string(), cell(original), cell(rewritten))
    };
    let cuda_only = "– (CUDA-only)";
    let mut rows = vec![row("steps run", &|r| r.losses.len().to_string())];
    let held_before = [original, rewritten]
        .iter()
        .any(|side| matches!(side, Ok(run) if run.allocated_at_begin.unwrap_or(0) > 0));
    if held_before {
        rows.push(row(
            "already allocated when the run began (the notebook's tensors; not counted below)",
            &|r| bytes_or(r.allocated_at_begin, cuda_only),
        ));
    }
    rows.extend([
        row("peak allocated by the loop", &|r| {
            bytes_or(r.peak_above_begin(), cuda_only)
        }),
        row(
            "… of which kept across steps (parameters, gradients, optimizer state)",
            &|r| bytes_or(r.kept_above_begin(), cuda_only),
        ),
        row(
            "… of which activations and temporaries (peak − kept, inferred)",
            &|r| bytes_or(transient(r), cuda_only),
        ),
        row("peak reserved by the loop", &|r| {
            bytes_or(
                r.peak_reserved
                    .map(|p| p.saturating_sub(r.allocated_at_begin.unwrap_or(0))),
                cuda_only,
            )
        }),
        row(
            "step time: median after the first (fastest–slowest)",
            &|r| match (r.typical_step_seconds(), r.step_range_seconds()) {
                (Some(median), Some((lo, hi))) => {
                    format!("{:.1} ms ({:.1}–{:.1})", median * 1e3, lo * 1e3, hi * 1e3)
                }
                (Some(median), None) => format!("{:.1} ms", median * 1e3),
                _ => "–".into(),
            },
        ),
        row("last loss", &|r| {
            r.losses.last().map_or("–".into(), |l| format!("{l:.5}"))
        }),
    ]);
    if let (Ok(a), Ok(b)) = (original, rewritten) {
        let pairs: Vec<(f64, f64)> = a
            .losses
            .iter()
            .copied()
            .zip(b.losses.iter().copied())
            .collect();
        // NaN would vanish in a max: say where a loss stopped being finite instead.
        let text = match pairs
            .iter()
            .position(|(x, y)| !x.is_finite() || !y.is_finite())
        {
            Some(step) => format!("NaN/inf at step {}", step + 1),
            None => {
                let diff = pairs.iter().map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
                format!("{diff:.3e}")
            }
        };
        rows.push((
            "largest loss difference over the common steps".into(),
            String::new(),
            text,
        ));
    }
    rows
}

/// The verdict line: the saving in bytes and percent, and the time cost.
pub fn verdict(original: &Side, rewritten: &Side) -> String {
    match (original, rewritten) {
        (Err(a), Err(b)) if a.is_out_of_memory() && b.is_out_of_memory() => {
            "Neither fits: the original and the rewritten loop both ran out of memory. This \
             technique alone is not enough here; combine it with another (flags can be given \
             together)."
                .to_string()
        }
        (Err(why), Ok(run)) => format!(
            "The original failed ({why}); the rewritten loop ran {} steps{}.",
            run.losses.len(),
            run.peak_above_begin().map_or(String::new(), |p| format!(
                " with a peak of {}{}",
                human_bytes(p),
                held_before(run)
            ))
        ),
        (_, Err(why)) => format!("The rewritten loop failed: {why}"),
        (Ok(a), Ok(b)) => {
            let memory = match (a.peak_above_begin(), b.peak_above_begin()) {
                (Some(pa), Some(pb)) if pa > 0 => {
                    let saved = pa as i128 - pb as i128;
                    format!(
                        "Peak memory {} → {}{}: {} {} ({:.1}%).",
                        human_bytes(pa),
                        human_bytes(pb),
                        held_before(a),
                        if saved >= 0 { "saves" } else { "costs" },
                        human_bytes(saved.unsigned_abs() as u64),
                        saved.abs() as f64 / pa as f64 * 100.0
                    )
                }
                _ => "Peak memory: CUDA-only (this kernel runs on CPU), so only time and loss \
                      are compared."
                    .to_string(),
            };
            let time = match (a.typical_step_seconds(), b.typical_step_seconds()) {
                (Some(ta), Some(tb)) if ta > 0.0 => {
                    format!(
                        " Step time ×{:.2} ({:.1} → {:.1} ms).",
                        tb / ta,
                        ta * 1e3,
                        tb * 1e3
                    )
                }
                _ => String::new(),
            };
            memory + &time + &spread_caveat(a, b) + &algorithm_search_note(a, b)
        }
    }
}

/// " (above the … the notebook already held)", when it held anything.
fn held_before(run: &CompareRun) -> String {
    match run.allocated_at_begin {
        Some(bytes) if bytes > 0 => format!(
            " (above the {} the notebook already held)",
            human_bytes(bytes)
        ),
        _ => String::new(),
    }
}

/// Step times that vary a lot from step to step make the ratio a guess: say so, and how to
/// firm it up.
fn spread_caveat(a: &CompareRun, b: &CompareRun) -> String {
    let spread = |run: &CompareRun| {
        run.step_range_seconds()
            .filter(|(lo, _)| *lo > 0.0)
            .map_or(1.0, |(lo, hi)| hi / lo)
    };
    let widest = spread(a).max(spread(b));
    if widest > 1.25 {
        format!(
            " Step times varied up to {widest:.1}x from step to step, so the time ratio is \
             rough: compare more steps (--compare N), on an otherwise idle machine."
        )
    } else {
        String::new()
    }
}

/// Where `--compare` ran the sides again under cuDNN's benchmark mode
/// (`first_run_peak_reserved`): that the table shows the second runs, and what a first run
/// reserved where it was over a twentieth more (the timing of cuDNN's algorithms, which a model
/// without convolutions does not do).
fn algorithm_search_note(a: &CompareRun, b: &CompareRun) -> String {
    let above_begin =
        |run: &CompareRun, peak: u64| peak.saturating_sub(run.allocated_at_begin.unwrap_or(0));
    let more_at_first = |name: &str, run: &CompareRun| {
        let first = above_begin(run, run.first_run_peak_reserved?);
        let second = above_begin(run, run.peak_reserved?);
        (first as f64 > second as f64 * 1.05).then(|| format!("{name} {}", human_bytes(first)))
    };
    if a.first_run_peak_reserved.is_none() && b.first_run_peak_reserved.is_none() {
        return String::new();
    }
    let mut note = " cuDNN's benchmark mode was on: each side ran twice, and the table shows the \
                    second run, on the algorithms cuDNN chose in the first."
        .to_string();
    let more: Vec<String> = [("original", a), ("rewritten", b)]
        .into_iter()
        .filter_map(|(name, run)| more_at_first(name, run))
        .collect();
    if !more.is_empty() {
        note.push_str(&format!(
            " While it timed them, the first run reserved more (by the loop): {}.",
            more.join(", ")
        ));
    }
    note
}

/// Loss curves of both runs (SVG).
fn loss_chart(original: &Side, rewritten: &Side) -> Result<String, String> {
    let same = matches!((original, rewritten), (Ok(a), Ok(b)) if a.losses == b.losses);
    // The original is drawn wide and pale under the rewritten line, so that where the two
    // coincide both stay visible; the legend says when they are identical.
    let series: Vec<(&str, &Vec<f64>, ShapeStyle)> = [
        (
            if same {
                "original (identical)"
            } else {
                "original"
            },
            original,
            RGBColor(96, 125, 139).mix(0.45).stroke_width(7),
        ),
        (
            "rewritten",
            rewritten,
            RGBColor(238, 76, 44).stroke_width(2),
        ),
    ]
    .into_iter()
    .filter_map(|(name, side, style)| side.as_ref().ok().map(|r| (name, &r.losses, style)))
    .filter(|(_, losses, _)| !losses.is_empty())
    .collect();
    let all: Vec<f64> = series
        .iter()
        .flat_map(|(_, l, _)| l.iter().copied())
        .filter(|v| v.is_finite())
        .collect();
    if all.is_empty() {
        return Ok(String::new());
    }
    let (lo, hi) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
    let pad = ((hi - lo) * 0.1).max(1e-6);
    let steps = series.iter().map(|(_, l, _)| l.len()).max().unwrap_or(1);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (640, 260)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(&root)
            .caption("loss per step", font(TITLE_PX))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(72)
            .build_cartesian_2d(1usize..steps.max(2), (lo - pad)..(hi + pad))
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss")
            .label_style(font(TEXT_PX))
            .axis_desc_style(font(TEXT_PX))
            .light_line_style(WHITE)
            .draw()
            .map_err(|e| e.to_string())?;
        for (name, losses, style) in series {
            chart
                .draw_series(LineSeries::new(
                    losses.iter().enumerate().map(|(i, &v)| (i + 1, v)),
                    style,
                ))
                .map_err(|e| e.to_string())?
                .label(name)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], style));
        }
        chart
            .configure_series_labels()
            .label_font(font(TEXT_PX))
            .border_style(BLACK)
            .background_style(WHITE)
            .draw()
            .map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

/// The comparison as a rich output.
pub fn comparison_display(flags: &str, original: &Side, rewritten: &Side) -> Display {
    let rows = rows(original, rewritten);
    let verdict = verdict(original, rewritten);
    let width = rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(0);
    let mut text = format!("%%optimize {flags} --compare\n{verdict}\n");
    text.push_str(&format!(
        "{:width$}  {:>16}  {:>16}\n",
        "", "original", "rewritten"
    ));
    for (what, a, b) in &rows {
        text.push_str(&format!("{what:width$}  {a:>16}  {b:>16}\n"));
    }
    let table: String = rows
        .iter()
        .map(|(what, a, b)| {
            format!(
                "<tr><td>{}</td><td style='text-align:right'>{}</td>\
                 <td style='text-align:right'>{}</td></tr>",
                escape(what),
                escape(a),
                escape(b)
            )
        })
        .collect();
    let chart = embed::chart_html(loss_chart(original, rewritten), "loss by step");
    let html = format!(
        "<div class='tchmem-compare'><div><b>{}</b></div><div>{}</div>\
         <table><tr><th></th><th>original</th><th>rewritten</th></tr>{table}</table>{chart}</div>",
        escape(&format!("%%optimize {flags} --compare")),
        escape(&verdict)
    );
    let mut data = Map::new();
    data.insert("text/plain".into(), Value::String(text));
    data.insert("text/html".into(), Value::String(html));
    let side_json = |side: &Side| match side {
        Ok(run) => serde_json::to_value(run).unwrap_or_default(),
        Err(why) => {
            serde_json::json!({ "error": why.to_string(), "error_name": why.name.as_str() })
        }
    };
    data.insert(
        COMPARISON_MIME.into(),
        serde_json::json!({
            "flags": flags,
            "original": side_json(original),
            "rewritten": side_json(rewritten),
        }),
    );
    Display {
        data,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(peak: Option<u64>, losses: Vec<f64>) -> CompareRun {
        CompareRun {
            steps_wanted: losses.len(),
            step_seconds: vec![1.0, 0.1, 0.1],
            losses,
            peak_allocated: peak,
            allocated_after_step: peak.map(|p| p / 2),
            ..Default::default()
        }
    }

    #[test]
    fn the_saving_is_given_in_bytes_and_percent() {
        let a = Ok(run(Some(4 << 30), vec![3.0, 2.0, 1.0]));
        let b = Ok(run(Some(1 << 30), vec![3.0, 2.0, 1.001]));
        let text = verdict(&a, &b);
        assert!(text.contains("saves 3.0 GiB (75.0%)"), "{text}");
        let display = comparison_display("--checkpoint", &a, &b);
        let html = display.data["text/html"].as_str().unwrap();
        let charts = embed::svgs_in(html);
        assert!(
            charts.len() == 1 && charts[0].contains("rewritten"),
            "{html}"
        );
        let plain = display.data["text/plain"].as_str().unwrap();
        assert!(plain.contains("1.000e-3"), "{plain}");
    }

    #[test]
    fn second_runs_under_benchmark_mode_are_named_and_a_costly_first_run_is_told() {
        let twice = |first: u64, second: u64| {
            let mut side = run(Some(1 << 30), vec![3.0, 2.0, 1.0]);
            side.peak_reserved = Some(second);
            side.first_run_peak_reserved = Some(first);
            side
        };
        // A transformer: the first runs reserved what the second did.
        let text = verdict(&Ok(twice(2 << 30, 2 << 30)), &Ok(twice(1 << 30, 1 << 30)));
        assert!(text.contains("each side ran twice"), "{text}");
        assert!(!text.contains("reserved more"), "{text}");
        // A conv net whose rewritten side met new shapes.
        let text = verdict(&Ok(twice(2 << 30, 2 << 30)), &Ok(twice(3 << 30, 1 << 30)));
        assert!(
            text.contains("the first run reserved more (by the loop): rewritten 3.0 GiB."),
            "{text}"
        );
        // Without the mode, nothing.
        let plain = Ok(run(Some(1 << 30), vec![3.0, 2.0, 1.0]));
        assert!(!verdict(&plain, &plain.clone()).contains("cuDNN"));
    }

    #[test]
    fn both_sides_out_of_memory_is_a_verdict_and_other_failures_are_not() {
        let oom: Side = Err(SideFailure::new(
            ErrorName::OutOfMemory,
            "CUDA ran out of memory in this cell",
        ));
        let plain =
            comparison_display("--amp bf16", &oom, &oom.clone()).data["text/plain"].to_string();
        assert!(plain.contains("Neither fits"), "{plain}");
        assert!(!SideFailure::new(ErrorName::Panic, "boom").is_out_of_memory());
    }

    #[test]
    fn a_loss_that_turns_nan_is_named_not_hidden() {
        let a = Ok(run(None, vec![3.0, 2.0, 1.0]));
        let b = Ok(run(None, vec![3.0, f64::NAN, 1.0]));
        let plain = comparison_display("--amp f16", &a, &b).data["text/plain"].to_string();
        assert!(plain.contains("NaN/inf at step 2"), "{plain}");
    }

    #[test]
    fn cpu_runs_say_memory_is_cuda_only_and_a_failed_original_is_shown() {
        let a: Side = Err(SideFailure::new(
            ErrorName::OutOfMemory,
            "CUDA ran out of memory",
        ));
        let b = Ok(run(None, vec![1.0]));
        assert!(verdict(&a, &b).starts_with("The original failed"));
        let text = verdict(&Ok(run(None, vec![1.0])), &b);
        assert!(text.contains("CUDA-only"), "{text}");
        let plain = comparison_display("--amp bf16", &a, &b).data["text/plain"].to_string();
        assert!(plain.contains("failed: OutOfMemory"), "{plain}");
    }

    #[test]
    fn peaks_leave_out_what_the_notebook_already_held() {
        let held = |peak: u64| {
            let mut r = run(Some(peak), vec![1.0, 0.5, 0.25]);
            r.allocated_at_begin = Some(100 << 30);
            r.allocated_after_step = Some((100 << 30) + (2 << 30));
            r
        };
        let (a, b) = (Ok(held(110 << 30)), Ok(held(104 << 30)));
        let text = verdict(&a, &b);
        assert!(
            text.contains("10.0 GiB → 4.0 GiB (above the 100.0 GiB the notebook already held)"),
            "{text}"
        );
        let plain = comparison_display("--checkpoint", &a, &b).data["text/plain"].to_string();
        assert!(
            plain.contains("already allocated when the run began"),
            "{plain}"
        );
    }

    #[test]
    fn step_times_that_swing_come_with_a_caveat() {
        let steady = run(None, vec![1.0, 0.5, 0.25]);
        let mut swinging = steady.clone();
        swinging.step_seconds = vec![1.0, 0.1, 0.4];
        assert!(!verdict(&Ok(steady.clone()), &Ok(steady.clone())).contains("rough"));
        let text = verdict(&Ok(steady), &Ok(swinging));
        assert!(text.contains("varied up to 4.0x"), "{text}");
    }

    #[test]
    fn identical_loss_curves_are_named_in_the_legend() {
        let a = Ok(run(None, vec![3.0, 2.0, 1.0]));
        let chart = loss_chart(&a, &a.clone()).unwrap();
        assert!(chart.contains("original (identical)"), "{chart}");
        let b = Ok(run(None, vec![3.0, 2.0, 1.5]));
        assert!(!loss_chart(&a, &b).unwrap().contains("identical"));
    }
}
