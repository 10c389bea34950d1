//! Displays of the "will it fit?" magics: an estimate against the device's capacity, the live
//! table of trials, and `--fit`'s ranking.

use serde_json::{json, Map, Value};
use tchmem_wire::memory::{Category, CategoryName};
use tchmem_wire::mime::{ESTIMATE_MIME, TRIALS_MIME};
use tchmem_wire::Display;

use super::chart;
use super::embed;
use super::escape;
use super::format::human_bytes;
use crate::fit::candidates::Candidate;
use crate::fit::estimate::Fixed;
use crate::fit::estimate::{CacheSource, MicroBatches, Prediction, StepTime};
use crate::fit::trial::{AlgorithmSearch, Measured, Outcome, Trial};
use crate::rewrite::Options;

/// A table: header and rows of cells, as HTML and as aligned text.
pub struct Table {
    /// Column names.
    pub header: Vec<String>,
    /// Rows.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    fn html(&self) -> String {
        let row = |cells: &[String], tag: &str| {
            // Numbers stay on one line; the last column (explanations) wraps.
            let last = cells.len().saturating_sub(1);
            let cells: String = cells
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let wrap = if i == last { "" } else { ";white-space:nowrap" };
                    format!(
                        "<{tag} style='text-align:left;padding:2px 8px{wrap}'>{}</{tag}>",
                        escape(c)
                    )
                })
                .collect();
            format!("<tr>{cells}</tr>")
        };
        let body: String = self.rows.iter().map(|r| row(r, "td")).collect();
        format!(
            "<table style='border-collapse:collapse;font-family:sans-serif;font-size:13px'>\
             {}{body}</table>",
            row(&self.header, "th")
        )
    }

    fn text(&self) -> String {
        let columns = self.header.len();
        let width = |i: usize| {
            std::iter::once(&self.header)
                .chain(&self.rows)
                .map(|r| r.get(i).map_or(0, |c| c.chars().count()))
                .max()
                .unwrap_or(0)
        };
        let widths: Vec<usize> = (0..columns).map(width).collect();
        std::iter::once(&self.header)
            .chain(&self.rows)
            .map(|r| {
                r.iter()
                    .zip(&widths)
                    .map(|(c, w)| format!("{c:<w$}"))
                    .collect::<Vec<_>>()
                    .join("  ")
                    .trim_end()
                    .to_string()
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// A trial as a table row: number, batch, rewrites, verdict, peak reserved, step time, last
/// loss.
pub fn trial_row(n: usize, trial: &Trial, verdict: &str) -> Vec<String> {
    let flags = trial.options.flags();
    let (peak, time, loss) = match &trial.outcome {
        Outcome::Ran(m) => (
            if m.cuda {
                human_bytes(m.peak_reserved)
            } else {
                "— (no CUDA)".into()
            },
            match m.gpu_busy_seconds {
                // The GPU's work in its profiled step: how much of the step is launching.
                Some(busy) => format!("{:.1} ms (GPU {:.1})", m.step_seconds * 1e3, busy * 1e3),
                None => format!("{:.1} ms", m.step_seconds * 1e3),
            },
            m.losses.last().map_or(String::new(), |l| format!("{l:.4}")),
        ),
        _ => ("—".into(), "—".into(), String::new()),
    };
    vec![
        n.to_string(),
        trial.batch.to_string(),
        if flags.is_empty() {
            "as written".into()
        } else {
            flags
        },
        verdict.to_string(),
        peak,
        time,
        loss,
    ]
}

/// The columns of [`trial_row`].
pub fn trial_header() -> Vec<String> {
    [
        "#",
        "batch",
        "rewrites",
        "result",
        "peak reserved",
        "step",
        "loss",
    ]
    .map(String::from)
    .to_vec()
}

/// A table with a heading and lines of text under it, under a display id (for live updates).
pub fn table_display(
    heading: &str,
    table: &Table,
    lines: &[String],
    numbers: Value,
    id: Option<(&str, bool)>,
) -> Display {
    let mut data = Map::new();
    let text = format!("{heading}\n{}\n{}", table.text(), lines.join("\n"));
    data.insert(
        "text/plain".into(),
        Value::String(text.trim_end().to_string()),
    );
    let lines_html: String = lines
        .iter()
        .map(|l| format!("<div>{}</div>", escape(l)))
        .collect();
    data.insert(
        "text/html".into(),
        Value::String(format!(
            "<div class='tchmem-fit'><b>{}</b>{}{lines_html}</div>",
            escape(heading),
            table.html()
        )),
    );
    data.insert(TRIALS_MIME.into(), numbers);
    Display {
        data,
        metadata: Map::new(),
        display_id: id.map(|(id, _)| id.to_string()),
        update: id.is_some_and(|(_, update)| update),
    }
}

/// What an estimate is of and against.
pub struct EstimateView<'a> {
    /// What was predicted ("batch 64, --checkpoint, AdamW").
    pub what: String,
    /// The prediction.
    pub prediction: &'a Prediction,
    /// The CUDA context and library workspaces, measured.
    pub context: u64,
    /// The device's capacity: what the allocator may take, plus the context.
    pub capacity: u64,
    /// The calibration trials.
    pub trials: &'a [Trial],
    /// A trial at the predicted batch (`--check`), if one ran.
    pub check: Option<&'a Trial>,
}

/// The verdict of an estimate, in words: whether it fits, by how much.
pub fn verdict(total: u64, capacity: u64) -> String {
    if total <= capacity {
        format!(
            "fits: {} of {} ({} to spare)",
            human_bytes(total),
            human_bytes(capacity),
            human_bytes(capacity - total)
        )
    } else {
        format!(
            "does not fit: {} of {} ({} over)",
            human_bytes(total),
            human_bytes(capacity),
            human_bytes(total - capacity)
        )
    }
}

/// An estimate: the predicted categories as a bar against the capacity, the verdict, the
/// categories with how each was found, and the calibration trials.
pub fn estimate_display(view: &EstimateView) -> Display {
    let mut categories: Vec<Category> = view.prediction.categories.clone();
    categories.push(Category {
        name: CategoryName::CudaContext,
        bytes: view.context,
        exact: false,
        how: "measured: NVML's process usage beyond the allocator".into(),
    });
    let total: u64 = categories.iter().map(|c| c.bytes).sum();
    // Where peak reserved is a range, its high end may not fit where the point does.
    let prediction = view.prediction;
    let total_at_high = prediction
        .reserved_spread
        .map(|_| total + prediction.peak_reserved_high() - prediction.peak_reserved);
    let mut verdict = verdict(total, view.capacity);
    if let Some(high) = total_at_high.filter(|&h| total <= view.capacity && h > view.capacity) {
        verdict.push_str(&format!(
            "; not at the high end of its peak reserved range ({} over)",
            human_bytes(high - view.capacity)
        ));
    }
    let title = format!("predicted peak, {}", view.what);
    let svg = embed::chart_html(
        chart::stacked_bar_against(&title, &categories, view.capacity),
        &title,
    );
    let table = Table {
        header: ["category", "bytes", "how"].map(String::from).to_vec(),
        rows: CategoryName::ALL
            .iter()
            .filter_map(|name| categories.iter().find(|c| c.name == *name && c.bytes > 0))
            .map(|c| {
                vec![
                    c.name.label().to_string(),
                    human_bytes(c.bytes),
                    format!("{}{}", if c.exact { "exact: " } else { "" }, c.how),
                ]
            })
            .collect(),
    };
    let trials = Table {
        header: trial_header(),
        rows: view
            .trials
            .iter()
            .enumerate()
            .map(|(i, t)| trial_row(i + 1, t, "calibration"))
            .collect(),
    };
    let step_time = &view.prediction.step_time;
    let spread = view.prediction.reserved_spread;
    let search = largest_algorithm_search(view.trials.iter().chain(view.check));
    let step = format!(
        "{}{}",
        prediction_lines(view.prediction),
        search.map_or(String::new(), algorithm_search_line)
    );
    let measured = view.check.and_then(|t| t.outcome.measured());
    let check = check_line(view, measured);
    let mut data = Map::new();
    data.insert(
        "text/plain".into(),
        Value::String(format!(
            "Estimate, {}: {verdict}\n{}\n{step}{check}\nCalibration trials:\n{}",
            view.what,
            table.text(),
            trials.text()
        )),
    );
    data.insert(
        "text/html".into(),
        Value::String(format!(
            // The step time and the reserved range are lines of their own, as in the text.
            "<div class='tchmem-estimate'>{svg}<div><b>{}</b></div>{}\
             <div style='white-space:pre-line'>{}</div>{}\
             <details><summary>calibration trials</summary>{}</details></div>",
            escape(&verdict),
            table.html(),
            escape(&step),
            if check.is_empty() {
                String::new()
            } else {
                format!("<div><b>{}</b></div>", escape(check.trim()))
            },
            trials.html()
        )),
    );
    data.insert(
        ESTIMATE_MIME.into(),
        json!({
            "what": view.what,
            "peak_allocated": view.prediction.peak_allocated,
            "peak_reserved": view.prediction.peak_reserved,
            "peak_reserved_low": spread.map(|(low, _)| low),
            "peak_reserved_high": spread.map(|(_, high)| high),
            "peak_reserved_why": spread.map(|_| range_reason(view.prediction.cache_source)),
            "algorithm_search_peak_reserved": search.map(|(_, s, _)| s.peak_reserved),
            "context": view.context,
            "capacity": view.capacity,
            "fits": total <= view.capacity,
            "fits_at_range_high": total_at_high.map(|h| h <= view.capacity),
            "step_seconds": view.prediction.step_seconds,
            "step_seconds_low": step_time.low,
            "step_seconds_high": step_time.high,
            "launch_bound": step_time.launch_bound,
            "host_bound": step_time.host_bound,
            "predicted_gpu_busy_seconds": step_time.gpu_work,
            "micro_batch": view.prediction.micro_batch,
            "categories": categories,
            "measured_peak_allocated": measured.map(|m| m.peak_allocated),
            "measured_peak_reserved": measured.map(|m| m.peak_reserved),
            "measured_step_seconds": measured.map(|m| m.step_seconds),
            "checked": view.check.map(|t| match &t.outcome {
                Outcome::Ran(_) => "ran".to_string(),
                other => format!("{other:?}"),
            }),
        }),
    );
    Display {
        data,
        ..Default::default()
    }
}

/// Why the peak reserved is a range, as the estimate's JSON names it.
fn range_reason(source: CacheSource) -> &'static str {
    match source {
        CacheSource::Scaled | CacheSource::Rules => "trials_disagree",
        CacheSource::RulesMissedTrial => "rules_missed_trial",
        CacheSource::RulesSegmentOrder => "segment_order",
        CacheSource::RulesSegmentPlacement => "segment_placement",
        CacheSource::RulesFirstSteps => "first_steps",
    }
}

/// Why the predicted step time is a range (empty where it is a number).
fn why_step_range(step_time: &StepTime) -> String {
    const HOST_BOUND: &str = ": bound by the host at the calibration batches (their GPU was idle \
        for over a third of their fastest steps: launches and the loop's own CPU work set their \
        time, which does not follow the batch): the longer of their mean step (the host's time) \
        and the GPU's work here, as the host launches ahead of the GPU; from their fastest step \
        (or the work, if more) up to their slowest steps' line or time in proportion to the \
        batch, where the work may take over";
    const LAUNCH_BOUND: &str =
        ": launch-bound at the calibration batches (their steps barely grew with the batch)";
    const PAST_THE_TRIALS: &str = ": a range, up to the larger calibration trial's step in \
        proportion to the batch: past the calibration batches their line keeps the small \
        steps' fixed costs, such as kernel launches, where a large step may be all work";
    const UP_TO_THE_TRIALS_STEPS: &str =
        "up to as many steps as the trials ran them, each with its optimizer step";
    if !step_time.is_range() {
        return String::new();
    }
    let lead = if step_time.launch_bound {
        LAUNCH_BOUND
    } else if step_time.past_the_trials {
        PAST_THE_TRIALS
    } else {
        ""
    };
    match step_time.micro_batches {
        MicroBatches::One if step_time.host_bound => HOST_BOUND.to_string(),
        MicroBatches::One if step_time.launch_bound => format!(
            "{lead}: from their fastest step to time in proportion to the batch, where the work \
             may take over"
        ),
        MicroBatches::One if step_time.past_the_trials => format!(
            "{lead} (the lower end is the line, or the fastest steps' where they are short)"
        ),
        MicroBatches::One => ": a range, from the calibration trials' fastest and slowest \
            steps (short steps vary with launches and the allocator's growth)"
            .to_string(),
        _ if step_time.host_bound => {
            format!("{HOST_BOUND}; with micro-batches, {UP_TO_THE_TRIALS_STEPS}")
        }
        kind => {
            let from = if kind == MicroBatches::DownToGpuWork {
                "the GPU's work in them, as the host launches the next while the GPU works"
            } else {
                "the calibration trials' fastest steps"
            };
            // After a lead, a second clause; alone, the reason itself.
            let lead = if lead.is_empty() {
                ": ".to_string()
            } else {
                format!("{lead}; ")
            };
            format!(
                "{lead}micro-batches back to back, where the trials waited for the GPU after \
                 each step: from {from}, {UP_TO_THE_TRIALS_STEPS}"
            )
        }
    }
}

/// What the estimate predicts beyond its table: the step time (and why it is a range), and
/// peak reserved as a range where the calibration trials' caches disagree, where the
/// allocator's rules missed the larger trial's own peak, or where the segment order decides it.
fn prediction_lines(prediction: &Prediction) -> String {
    let step_time = &prediction.step_time;
    let predicted_step = step_time.describe(prediction.step_seconds);
    let why_range = why_step_range(step_time);
    let why_reserved = match prediction.cache_source {
        CacheSource::RulesMissedTrial => {
            "the allocator's rules missed the larger calibration trial's own peak reserved, in \
             either order of its segments (it reserved what its requests do not explain)"
        }
        CacheSource::RulesSegmentOrder => {
            "which cached block the allocator reuses depends on where the device puts new \
             segments, unknown ahead, and at this batch that changes the peak: a run's peak \
             usually lands near one end or the other, and the point is off by the same percentage \
             whichever it takes"
        }
        CacheSource::RulesSegmentPlacement => {
            "which cached block the allocator reuses depends on where the device puts new \
             segments, unknown ahead: above or below the old ones they give the point, placed \
             between them another peak, which a run may take"
        }
        CacheSource::RulesFirstSteps => {
            "the loop's first steps make the gradients and the optimizer's state, unrecorded: \
             split into micro-batches as the rewrite runs them they give one end, as the plain \
             trials ran them the other, and a run's peak has landed near either; the point is off \
             by the same percentage whichever it takes"
        }
        CacheSource::Scaled | CacheSource::Rules => {
            "the calibration trials' caches disagree (the allocator's segments did not grow with \
             the batch alike)"
        }
    };
    let reserved_range = prediction
        .reserved_spread
        .map_or(String::new(), |(low, high)| {
            format!(
                "\npredicted peak reserved {}, between {} and {}: {why_reserved}",
                human_bytes(prediction.peak_reserved),
                human_bytes(low),
                human_bytes(high)
            )
        });
    format!(
        "predicted step time {predicted_step} (micro-batch {}){why_range}{}{reserved_range}",
        prediction.micro_batch,
        gpu_work_line(prediction)
    )
}

/// The trial (calibration or check) whose first run (cuDNN's benchmark mode: it timed cuDNN's
/// algorithms) reserved the most over its run on the chosen algorithms, with its batch and that run's peak
/// reserved; `None` where none reserved over a twentieth more (shapes the process had run).
fn largest_algorithm_search<'a>(
    trials: impl Iterator<Item = &'a Trial>,
) -> Option<(u64, AlgorithmSearch, u64)> {
    trials
        .filter_map(|t| {
            let m = t.outcome.measured()?;
            let search = m.algorithm_search?;
            (search.peak_reserved as f64 > m.peak_reserved as f64 * 1.05).then_some((
                t.batch,
                search,
                m.peak_reserved,
            ))
        })
        .max_by_key(|(_, search, _)| search.peak_reserved)
}

/// Under cuDNN's benchmark mode: what a first run at a new shape reserved beside the estimate,
/// and why it is not in it.
fn algorithm_search_line((batch, search, chosen): (u64, AlgorithmSearch, u64)) -> String {
    format!(
        "\ncuDNN's benchmark mode is on: the first step at a shape new to the process times \
         cuDNN's algorithms. The trial at {batch} reserved {} in its first run, {} when run \
         again on the algorithms chosen; the figures above are for the latter. The notebook's \
         own first steps at a new batch may reserve more, up to what is free.",
        human_bytes(search.peak_reserved),
        human_bytes(chosen)
    )
}

/// The GPU's own work at the batch, where the trials profiled it, and whether it set the point.
fn gpu_work_line(prediction: &Prediction) -> String {
    let Some(work) = prediction.step_time.gpu_work else {
        return String::new();
    };
    let sets_the_point = work >= prediction.step_seconds * 0.999;
    format!(
        "\nthe GPU's own work in a step at this batch: {:.1} ms (a line through the calibration \
         trials' profiled steps){}",
        work * 1e3,
        if sets_the_point {
            ", at least what the line through their wall times gives: the point (a step is no \
             faster than its GPU's work)"
        } else {
            ""
        }
    )
}

/// The check trial's verdict on the prediction (empty without one).
fn check_line(view: &EstimateView, measured: Option<&Measured>) -> String {
    let prediction = view.prediction;
    let step_time = &prediction.step_time;
    let error = |predicted: u64, measured: u64| {
        (predicted as f64 - measured as f64) / (measured.max(1) as f64)
    };
    match (view.check, measured) {
        (Some(_), Some(m)) => format!(
            "\nChecked by a trial at the batch: peak allocated {} (predicted {}, {:+.1}%), \
             reserved {} (predicted {}, {:+.1}%{}), step {:.1} ms (predicted {}{}){}.",
            human_bytes(m.peak_allocated),
            human_bytes(prediction.peak_allocated),
            error(prediction.peak_allocated, m.peak_allocated) * 100.0,
            human_bytes(m.peak_reserved),
            human_bytes(prediction.peak_reserved),
            error(prediction.peak_reserved, m.peak_reserved) * 100.0,
            match prediction.reserved_spread {
                Some((low, high)) => format!(
                    "; range {}-{}: {}",
                    human_bytes(low),
                    human_bytes(high),
                    range_verdict(low, high, m.peak_reserved)
                ),
                None => String::new(),
            },
            m.step_seconds * 1e3,
            step_time.describe(prediction.step_seconds),
            match (step_time.is_range(), step_time.holds(m.step_seconds)) {
                (true, true) if (step_time.low..=step_time.high).contains(&m.step_seconds) => {
                    ": within"
                }
                (true, true) => ": within a tenth of it",
                (true, false) => ": outside",
                (false, _) => "",
            },
            host_time_note(step_time, m),
        ),
        (Some(trial), None) => format!(
            "\nChecked by a trial at the batch: it {}.",
            match &trial.outcome {
                Outcome::OutOfMemory => "ran out of memory".to_string(),
                Outcome::Failed(why) => format!("failed ({why})"),
                Outcome::Ran(_) => "ran".to_string(),
            }
        ),
        (None, _) => String::new(),
    }
}

/// "within", or how far outside, as a share of the end it passed: a range's end is a prediction
/// too, and 2 MiB over a 4 GiB range is not the miss 124 MiB under one is (an H100's VGG-style
/// net at 256 and min_gpt at 128, `results/gpu/2026-12-06-reserved-middle/`).
fn range_verdict(low: u64, high: u64, measured: u64) -> String {
    let (by, end, side) = if measured > high {
        (measured - high, high, "over its high end")
    } else if measured < low {
        (low - measured, low, "under its low end")
    } else {
        return "within".to_string();
    };
    format!(
        "outside, {} {side} ({:.2}% of that end)",
        human_bytes(by),
        by as f64 * 100.0 / end.max(1) as f64
    )
}

/// Where a host-bound check fell outside its range by over a tenth, what set its length: the
/// GPU was busy for under half of it, so the host's own work did, and that varies from trial to
/// trial, not with the batch (char_rnn on an H100: its plain steps took 8-47 ms at one batch
/// with tch's 16 CPU threads, 9.5-13 ms with one; `results/gpu/2026-12-06-corpus/`). Either
/// way: a check may land in a slow spell of the host, or its calibration trials may have.
fn host_time_note(step_time: &StepTime, m: &Measured) -> String {
    let Some(work) = m.gpu_busy_seconds else {
        return String::new();
    };
    // Outside exactly where the verdict says so.
    if !step_time.host_bound || step_time.holds(m.step_seconds) || work * 2.0 > m.step_seconds {
        return String::new();
    }
    let (fastest, slowest) = m.step_range;
    let spread = if slowest > fastest * 1.5 {
        format!(
            " (its steps took {:.1}-{:.1} ms)",
            fastest * 1e3,
            slowest * 1e3
        )
    } else {
        String::new()
    };
    format!(
        "; the GPU was busy {:.1} ms of it: the host's own work set its length{spread}, and that \
         varies from trial to trial, not with the batch (CPU tensor work on many threads can \
         make it so: see the estimates' documentation, docs/fit.md)",
        work * 1e3
    )
}

/// A trial's verdict in a table: ran, out of memory, or why it failed.
pub fn verdict_of(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Ran(_) => "ran".into(),
        Outcome::OutOfMemory => "out of memory".into(),
        Outcome::Failed(why) => format!("failed: {why}"),
    }
}

/// Where a live table's displays go (the cell's output).
pub type ShowDisplay = std::sync::Arc<dyn Fn(Display) + Send + Sync>;

/// A table of trials shown as they run (one display, updated in place).
pub struct LiveTable {
    id: String,
    heading: String,
    rows: Vec<Vec<String>>,
    numbers: Vec<serde_json::Value>,
    show: ShowDisplay,
}

impl LiveTable {
    /// An empty table shown as display `id` under `heading`.
    pub fn new(id: String, heading: String, show: ShowDisplay) -> LiveTable {
        LiveTable {
            id,
            heading,
            rows: Vec::new(),
            numbers: Vec::new(),
            show,
        }
    }

    /// Adds a trial's row with its verdict and shows the table.
    pub fn push(&mut self, trial: &Trial, verdict: &str) {
        self.rows
            .push(trial_row(self.rows.len() + 1, trial, verdict));
        let measured = trial.outcome.measured();
        let number = json!({
            "batch": trial.batch,
            "rewrites": trial.options.flags(),
            "verdict": verdict,
            "peak_allocated": measured.filter(|m| m.cuda).map(|m| m.peak_allocated),
            "peak_reserved": measured.filter(|m| m.cuda).map(|m| m.peak_reserved),
            "step_seconds": measured.map(|m| m.step_seconds),
            "losses": measured.map(|m| m.losses.clone()),
        });
        tracing::info!("trial {}: {number}", self.rows.len());
        self.numbers.push(number);
        self.show(&[]);
    }

    /// `display` in the table's place (the trials were progress; the result replaces them).
    pub fn replaced_by(&self, mut display: Display) -> Display {
        display.display_id = Some(self.id.clone());
        display.update = !self.rows.is_empty();
        display
    }

    /// Shows the table with `lines` under it.
    pub fn show(&self, lines: &[String]) {
        let table = Table {
            header: trial_header(),
            rows: self.rows.clone(),
        };
        (self.show)(table_display(
            &self.heading,
            &table,
            lines,
            json!({ "trials": self.numbers }),
            Some((&self.id, self.rows.len() > 1 || !lines.is_empty())),
        ));
    }
}

/// A configuration's name for people: its flags, or "as written".
pub fn name_of(options: &Options) -> String {
    match options.flags() {
        flags if flags.is_empty() => "the loop as written".into(),
        flags => flags,
    }
}

/// Whether a trial ran within `budget` (its peak reserved plus the context).
pub fn fits_in(trial: &Trial, budget: u64, context: u64) -> bool {
    trial
        .outcome
        .measured()
        .is_some_and(|m| m.peak_reserved + context <= budget)
}

/// The verdict of `--fit`'s trial of a leaner optimizer: its step's time beside the cell's
/// optimizer's (`own`, in the calibration trial at the same batch), or why it has none.
pub fn verdict_of_optimizer_timing(trial: &Trial, own: f64) -> String {
    match trial
        .outcome
        .measured()
        .and_then(|m| m.optimizer_step_seconds)
    {
        Some(step) => format!(
            "optimizer step {:.1} ms (the cell's {:.1} ms)",
            step * 1e3,
            own * 1e3
        ),
        None if trial.outcome.measured().is_some() => {
            "optimizer step not timed: ranked at the cell's".into()
        }
        None => format!("{}: ranked at the cell's", verdict_of(&trial.outcome)),
    }
}

/// A confirmation's verdict in `--fit`'s table.
pub fn verdict_of_fit(trial: &Trial) -> String {
    match &trial.outcome {
        Outcome::Ran(_) => "over the budget".into(),
        other => verdict_of(other),
    }
}

/// `--fit`'s result table: each confirmed candidate's predicted and measured peak and step time,
/// and its losses against the first confirmed candidate that keeps the loop's arithmetic
/// (no mixed precision, the same optimizer).
pub fn fit_summary(confirmed: &[(Candidate, Trial)], budget: u64, context: u64) -> Display {
    let reference = confirmed
        .iter()
        .find(|(c, t)| {
            c.options.amp.is_none()
                && c.options.optimizer.is_none()
                && t.outcome.measured().is_some()
        })
        .and_then(|(c, t)| Some((name_of(&c.options), t.outcome.measured()?.losses.clone())));
    let mut rows = Vec::new();
    let mut numbers = Vec::new();
    for (candidate, trial) in confirmed {
        let measured = trial.outcome.measured();
        let agreement = match (&reference, measured) {
            (Some((_, losses)), Some(m)) => losses
                .iter()
                .zip(&m.losses)
                .map(|(a, b)| (a - b).abs() / a.abs().max(1e-12))
                // A NaN (a diverged loss) must show, not vanish in the maximum.
                .fold(0.0f64, |m, d| {
                    if m.is_nan() || d.is_nan() {
                        f64::NAN
                    } else {
                        m.max(d)
                    }
                }),
            _ => f64::NAN,
        };
        let prediction = &candidate.prediction;
        let high = prediction.peak_reserved_high();
        rows.push(vec![
            name_of(&candidate.options),
            if high > prediction.peak_reserved {
                format!(
                    "{} (up to {})",
                    human_bytes(prediction.peak_reserved + context),
                    human_bytes(high + context)
                )
            } else {
                human_bytes(prediction.peak_reserved + context)
            },
            measured.map_or_else(
                || verdict_of(&trial.outcome),
                |m| human_bytes(m.peak_reserved + context),
            ),
            prediction.step_time.describe(prediction.step_seconds),
            measured.map_or("—".into(), |m| format!("{:.1} ms", m.step_seconds * 1e3)),
            if reference.is_none() || measured.is_none() {
                "—".into()
            } else if agreement.is_nan() {
                "diverged (NaN)".into()
            } else {
                format!("{:.2}%", agreement * 100.0)
            },
            if fits_in(trial, budget, context) {
                "yes"
            } else {
                "no"
            }
            .into(),
        ]);
        numbers.push(json!({
            "rewrites": candidate.options.flags(),
            "predicted_peak_reserved": candidate.prediction.peak_reserved,
            "predicted_peak_reserved_high": prediction.reserved_spread.map(|_| high),
            "predicted_peak_allocated": candidate.prediction.peak_allocated,
            "measured_peak_reserved": measured.map(|m| m.peak_reserved),
            "measured_peak_allocated": measured.map(|m| m.peak_allocated),
            "predicted_step_seconds": candidate.prediction.step_seconds,
            "measured_step_seconds": measured.map(|m| m.step_seconds),
            "context": context,
            "fits": fits_in(trial, budget, context),
        }));
    }
    let table = Table {
        header: [
            "rewrites",
            "predicted peak",
            "measured peak",
            "predicted step",
            "measured step",
            "max loss difference",
            "fits",
        ]
        .map(String::from)
        .to_vec(),
        rows,
    };
    let mut lines = vec![format!(
        "Peaks count the allocator's reserved bytes plus {} of CUDA context; the budget is {}.",
        human_bytes(context),
        human_bytes(budget)
    )];
    if let Some((name, _)) = &reference {
        lines.push(format!("Loss differences are relative, against {name}."));
    }
    table_display(
        "%%optimize --fit: the candidates confirmed at the cell's batch",
        &table,
        &lines,
        json!({ "confirmed": numbers, "budget": budget }),
        None,
    )
}

/// On CPU: the fixed terms only, exact; `unread` names an optimizer whose state no rule counts
/// (one the notebook wrote).
pub fn fixed_terms_display(what: &str, fixed: &Fixed, unread: Option<&str>) -> Display {
    // No gradient term beside parameters: the optimizer steps in backward.
    let gradients = match (fixed.gradients, fixed.parameters) {
        (0, p) if p > 0 => "0 B (freed in backward, --step-in-backward)".to_string(),
        (g, _) => human_bytes(g),
    };
    let (state, total) = match unread {
        Some(optimizer) => (
            format!(
                "not counted: no rule counts the state of {optimizer}; trials on a CUDA device \
                 measure it"
            ),
            format!(
                "{}   without the optimizer's state",
                human_bytes(fixed.total())
            ),
        ),
        None => (
            human_bytes(fixed.optimizer_state),
            human_bytes(fixed.total()),
        ),
    };
    let text = format!(
        "Estimate, {what}: on CPU only the fixed terms are known (activations are calibrated on \
         the CUDA allocator's counters):\n  parameters       {}\n  gradients        {}\n  \
         optimizer state  {state}\n  total            {total}",
        human_bytes(fixed.parameters),
        gradients,
    );
    let mut display = crate::report::text_display(text);
    display.data.insert(
        ESTIMATE_MIME.into(),
        json!({
            "what": what,
            "parameters": fixed.parameters,
            "gradients": fixed.gradients,
            "optimizer_state": unread.is_none().then_some(fixed.optimizer_state),
        }),
    );
    display
}

/// The terms `%memestimate` knows before any training loop: a model and its optimizer.
pub struct ModelTerms<'a> {
    /// What the terms are of ("the model in `vs` (cell [2]), Adam `opt` (cell [2])").
    pub what: &'a str,
    /// The trainable parameters, their gradients and the optimizer's state.
    pub fixed: Fixed,
    /// Frozen variables: held, with no gradient or state.
    pub frozen: u64,
    /// What the optimizer state line counts.
    pub state: StateCounted<'a>,
    /// The CUDA context beside the allocator, and the device's memory (`None` on CPU).
    pub device: Option<(u64, u64)>,
    /// What else the notebook holds on the device now, beyond the stores' variables (its data, a
    /// frozen network on a store no optimizer trains): 0 on CPU.
    pub held: u64,
}

/// What the optimizer state line of [`ModelTerms`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateCounted<'a> {
    /// The state of the named rule.
    Rule(&'a str),
    /// None: no optimizer is built yet.
    NoOptimizer,
    /// Nothing: the optimizer's state cannot be read before it runs (one the notebook wrote,
    /// "`opt` (a `SparseAdam`, built in cell [4])").
    Unread(&'a str),
}

/// `%memestimate` before a training loop: the exact terms, what they leave of the device, and
/// what the rest needs.
pub fn model_terms_display(terms: &ModelTerms<'_>) -> Display {
    let fixed = &terms.fixed;
    let mut lines = vec![
        format!("%memestimate before any training loop: {}", terms.what),
        format!(
            "  parameters       {:>10}   the stores' variables{}",
            human_bytes(fixed.parameters + terms.frozen),
            if terms.frozen > 0 {
                format!(" ({} of them frozen)", human_bytes(terms.frozen))
            } else {
                String::new()
            }
        ),
        format!(
            "  gradients        {:>10}   one per trainable parameter, made by the first backward",
            human_bytes(fixed.gradients)
        ),
        match terms.state {
            StateCounted::Rule(rule) => format!(
                "  optimizer state  {:>10}   {rule}'s rule, made by the first step",
                human_bytes(fixed.optimizer_state)
            ),
            StateCounted::NoOptimizer => format!(
                "  optimizer state  {:>10}   no optimizer built yet (`--optimizer NAME` counts one)",
                human_bytes(fixed.optimizer_state)
            ),
            StateCounted::Unread(optimizer) => format!(
                "  optimizer state  not counted  {optimizer}: its state cannot be read before it \
                 runs. %memestimate on the training cell measures it in trials (on a CUDA \
                 device); `--optimizer NAME` counts a known rule's"
            ),
        },
    ];
    let total =
        fixed.total() + terms.frozen + terms.held + terms.device.map_or(0, |(context, _)| context);
    if terms.held > 0 {
        lines.push(format!(
            "  other tensors    {:>10}   on the device already, beside the model's stores (the \
             notebook's data, a network on another store)",
            human_bytes(terms.held)
        ));
    }
    if let Some((context, _)) = terms.device {
        lines.push(format!(
            "  CUDA context     {:>10}   measured (this process on the device, less the allocator)",
            human_bytes(context)
        ));
    }
    let unread = matches!(terms.state, StateCounted::Unread(_));
    lines.push(format!(
        "  total            {:>10}{}",
        human_bytes(total),
        if unread {
            "   without the optimizer's state"
        } else {
            ""
        }
    ));
    match terms.device {
        Some((_, device)) => lines.push(format!(
            "Of the device's {}, {} is left for the activations, the input batch and the \
             allocator's cache.",
            human_bytes(device),
            human_bytes(device.saturating_sub(total))
        )),
        None => lines.push("No CUDA device here: the terms are the model's, on the host.".into()),
    }
    lines.push(
        "The rest depends on the loop: run the training cell, then `%memestimate` alone (or on \
         the cell's first line) for a peak calibrated by short trials, at any `--batch N`."
            .into(),
    );
    let mut display = crate::report::text_display(lines.join("\n"));
    display.data.insert(
        ESTIMATE_MIME.into(),
        json!({
            "what": terms.what,
            "parameters": fixed.parameters + terms.frozen,
            "gradients": fixed.gradients,
            "optimizer_state": (!unread).then_some(fixed.optimizer_state),
            "context": terms.device.map(|(context, _)| context),
            "held": terms.held,
            "device": terms.device.map(|(_, device)| device),
        }),
    );
    display
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fit::estimate::{Calibration, Scenario};
    use tchmem_wire::estimate::OptimizerRule;

    #[test]
    fn a_check_outside_its_reserved_range_says_by_how_much() {
        const MIB: u64 = 1 << 20;
        assert_eq!(range_verdict(3550 * MIB, 4196 * MIB, 4000 * MIB), "within");
        assert_eq!(range_verdict(3550 * MIB, 4196 * MIB, 3550 * MIB), "within");
        assert_eq!(
            range_verdict(3550 * MIB, 4196 * MIB, 4198 * MIB),
            "outside, 2.0 MiB over its high end (0.05% of that end)"
        );
        assert_eq!(
            range_verdict(6560 * MIB, 6860 * MIB, 6436 * MIB),
            "outside, 124.0 MiB under its low end (1.89% of that end)"
        );
    }

    #[test]
    fn a_host_bound_check_outside_its_range_says_the_host_set_its_length() {
        let host_bound = StepTime {
            low: 0.010,
            high: 0.020,
            host_bound: true,
            ..Default::default()
        };
        let slow = Measured {
            step_seconds: 0.050,
            step_range: (0.012, 0.055),
            gpu_busy_seconds: Some(0.005),
            ..Default::default()
        };
        let note = host_time_note(&host_bound, &slow);
        assert!(
            note.contains(
                "the GPU was busy 5.0 ms of it: the host's own work set its length (its steps \
                 took 12.0-55.0 ms)"
            ),
            "{note}"
        );
        // Faster than the range (the calibration trials in a slow spell): the same note.
        let fast = Measured {
            step_seconds: 0.0085,
            step_range: (0.008, 0.009),
            gpu_busy_seconds: Some(0.004),
            ..Default::default()
        };
        let note = host_time_note(&host_bound, &fast);
        assert!(
            note.starts_with(
                "; the GPU was busy 4.0 ms of it: the host's own work set its length, "
            ),
            "{note}"
        );
        // Within the range or within a tenth of it, or a step that was mostly the GPU's
        // work, or a loop not bound by the host: nothing to say.
        for step_seconds in [0.019, 0.021] {
            let within = Measured {
                step_seconds,
                ..slow.clone()
            };
            assert_eq!(host_time_note(&host_bound, &within), "");
        }
        let working = Measured {
            gpu_busy_seconds: Some(0.040),
            ..slow.clone()
        };
        assert_eq!(host_time_note(&host_bound, &working), "");
        let launch_bound = StepTime {
            host_bound: false,
            ..host_bound
        };
        assert_eq!(host_time_note(&launch_bound, &slow), "");
    }

    #[test]
    fn an_estimate_shows_its_verdict_categories_and_capacity_line() {
        let measured = crate::fit::estimate::tests::simulated(16, 0, &OptimizerRule::Adam);
        let calibration = Calibration {
            points: vec![
                (
                    8,
                    crate::fit::estimate::tests::simulated(8, 0, &OptimizerRule::Adam),
                ),
                (16, measured.clone()),
            ],
            rule: OptimizerRule::Adam,
            gradients_in_backward: false,
            replayed: None,
        };
        let prediction = calibration
            .predict(&Scenario {
                batch: 64,
                accumulate: 1,
                rule: OptimizerRule::Adam,
                begin: 0,
                zero_ranks: None,
            })
            .unwrap();
        let trial = Trial {
            options: Default::default(),
            batch: 16,
            outcome: Outcome::Ran(Box::new(measured.clone())),
        };
        // An estimate for batch 64 on a card of 1 GiB (500 MiB of it the context).
        let on_a_1_gib_card = |prediction: &Prediction, trial: &Trial, check: Option<&Trial>| {
            estimate_display(&EstimateView {
                what: "batch 64".into(),
                prediction,
                context: 500 << 20,
                capacity: 1 << 30,
                trials: std::slice::from_ref(trial),
                check,
            })
        };
        let display = on_a_1_gib_card(&prediction, &trial, Some(&trial));
        let text = display.data["text/plain"].as_str().unwrap();
        assert!(text.contains("fits:"), "{text}");
        assert!(text.contains("exact: Adam's rule"), "{text}");
        assert!(text.contains("Checked by a trial at the batch"), "{text}");
        let html = display.data["text/html"].as_str().unwrap();
        let charts = embed::svgs_in(html);
        assert!(
            charts.len() == 1 && charts[0].contains("capacity 1.0 GiB"),
            "{html}"
        );
        assert_eq!(display.data[ESTIMATE_MIME]["fits"], true);
        assert_eq!(display.data[ESTIMATE_MIME]["host_bound"], false);
        assert_eq!(
            display.data[ESTIMATE_MIME]["peak_reserved_low"],
            Value::Null
        );
        assert_eq!(
            display.data[ESTIMATE_MIME]["peak_reserved_why"],
            Value::Null
        );
        assert_eq!(verdict(3, 2).split(':').next(), Some("does not fit"));
        assert!(!text.contains("benchmark mode"), "{text}");
        assert_eq!(
            display.data[ESTIMATE_MIME]["algorithm_search_peak_reserved"],
            Value::Null
        );

        // Trials under cuDNN's benchmark mode: the first run's peak is told apart.
        let searched = Trial {
            outcome: Outcome::Ran(Box::new(Measured {
                algorithm_search: Some(AlgorithmSearch {
                    peak_allocated: 3 << 30,
                    peak_reserved: 7 << 29,
                }),
                ..measured.clone()
            })),
            ..trial.clone()
        };
        let display = on_a_1_gib_card(&prediction, &searched, None);
        let text = display.data["text/plain"].as_str().unwrap();
        assert!(
            text.contains("benchmark mode is on")
                && text.contains("The trial at 16 reserved 3.5 GiB in its first run"),
            "{text}"
        );
        assert_eq!(
            display.data[ESTIMATE_MIME]["algorithm_search_peak_reserved"],
            json!(7u64 << 29)
        );
        // A first run that reserved no more (shapes the process had run) is not told.
        let seen = Trial {
            outcome: Outcome::Ran(Box::new(Measured {
                algorithm_search: Some(AlgorithmSearch {
                    peak_allocated: measured.peak_allocated,
                    peak_reserved: measured.peak_reserved,
                }),
                ..measured.clone()
            })),
            ..trial.clone()
        };
        let display = on_a_1_gib_card(&prediction, &seen, None);
        let text = display.data["text/plain"].as_str().unwrap();
        assert!(!text.contains("benchmark mode"), "{text}");

        // Trials whose caches disagree: peak reserved is told as a range, and checked against it.
        let spread = Prediction {
            reserved_spread: Some((prediction.peak_reserved, prediction.peak_reserved * 2)),
            ..prediction.clone()
        };
        let display = on_a_1_gib_card(&spread, &trial, Some(&trial));
        let text = display.data["text/plain"].as_str().unwrap();
        assert!(
            text.contains("the calibration trials' caches disagree"),
            "{text}"
        );
        // In HTML too, the reserved range is a line of its own below the step time.
        let html = display.data["text/html"].as_str().unwrap();
        assert!(
            html.contains("<div style='white-space:pre-line'>predicted step time")
                && html.contains("\npredicted peak reserved"),
            "{html}"
        );
        assert!(
            text.contains(": outside, ") && text.contains(" of that end)), step"),
            "{text}"
        );
        assert_eq!(
            display.data[ESTIMATE_MIME]["peak_reserved_high"],
            json!(prediction.peak_reserved * 2)
        );
        assert_eq!(
            display.data[ESTIMATE_MIME]["peak_reserved_why"],
            "trials_disagree"
        );
        // The point fits a card the range's high end does not: the verdict says both.
        let total = prediction.peak_reserved + (500 << 20);
        let tight = estimate_display(&EstimateView {
            what: "batch 64".into(),
            prediction: &spread,
            context: 500 << 20,
            capacity: total + (prediction.peak_reserved / 2),
            trials: std::slice::from_ref(&trial),
            check: None,
        });
        let text = tight.data["text/plain"].as_str().unwrap();
        assert!(
            text.contains("fits: ") && text.contains("; not at the high end of its peak"),
            "{text}"
        );
        assert_eq!(tight.data[ESTIMATE_MIME]["fits"], true);
        assert_eq!(tight.data[ESTIMATE_MIME]["fits_at_range_high"], false);

        // --fit's table shows a candidate's range where it has one.
        let candidate = |prediction: &Prediction| Candidate {
            options: Default::default(),
            prediction: prediction.clone(),
            fits: true,
            fits_at_high: true,
        };
        let summary = fit_summary(
            &[
                (candidate(&prediction), trial.clone()),
                (candidate(&spread), trial.clone()),
            ],
            1 << 40,
            500 << 20,
        );
        let text = summary.data["text/plain"].as_str().unwrap();
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("the loop as written"))
            .collect();
        assert_eq!(rows.len(), 2, "{text}");
        assert!(
            !rows[0].contains("up to") && rows[1].contains("(up to "),
            "{text}"
        );
        assert_eq!(
            summary.data[TRIALS_MIME]["confirmed"][1]["predicted_peak_reserved_high"],
            json!(prediction.peak_reserved * 2)
        );
        assert_eq!(
            summary.data[TRIALS_MIME]["confirmed"][0]["predicted_peak_reserved_high"],
            Value::Null
        );
        // A step predicted as a range shows as one.
        let ranged_step = Prediction {
            step_time: crate::fit::estimate::StepTime {
                low: 0.030,
                high: 0.060,
                launch_bound: true,
                host_bound: false,
                past_the_trials: false,
                gpu_work: None,
                micro_batches: MicroBatches::One,
            },
            step_seconds: 0.030,
            ..prediction.clone()
        };
        let summary = fit_summary(&[(candidate(&ranged_step), trial.clone())], 1 << 40, 0);
        let text = summary.data["text/plain"].as_str().unwrap();
        assert!(text.contains("30.0-60.0 ms"), "{text}");
        // Host-bound trials say why their line gives no number.
        let host_bound = Prediction {
            step_time: crate::fit::estimate::StepTime {
                launch_bound: false,
                host_bound: true,
                ..ranged_step.step_time
            },
            ..ranged_step.clone()
        };
        let text = prediction_lines(&host_bound);
        assert!(
            text.contains("30.0 ms (30.0-60.0 ms)") && text.contains("bound by the host"),
            "{text}"
        );
        assert!(
            text.contains("the longer of their mean step (the host's time) and the GPU's work"),
            "{text}"
        );
        assert!(!prediction_lines(&ranged_step).contains("bound by the host"));
        // Micro-batches back to back say where their range's ends come from.
        let accumulated = |micro_batches: MicroBatches, host_bound: bool| Prediction {
            step_time: crate::fit::estimate::StepTime {
                micro_batches,
                host_bound,
                ..ranged_step.step_time
            },
            ..ranged_step.clone()
        };
        let text = prediction_lines(&accumulated(MicroBatches::DownToGpuWork, false));
        assert!(
            text.contains(
                "): launch-bound at the calibration batches (their \
                 steps barely grew with the batch); micro-batches back to back, where the trials \
                 waited for the GPU after each step: from the GPU's work in them, as the host \
                 launches the next while the GPU works, up to as many steps as the trials ran \
                 them, each with its optimizer step"
            ),
            "{text}"
        );
        let text = prediction_lines(&accumulated(MicroBatches::FromTrialSteps, false));
        assert!(
            text.contains("from the calibration trials' fastest steps, up to"),
            "{text}"
        );
        // Without a lead (neither launch-bound nor past the trials), the reason stands alone.
        let alone = Prediction {
            step_time: crate::fit::estimate::StepTime {
                launch_bound: false,
                ..accumulated(MicroBatches::DownToGpuWork, false).step_time
            },
            ..ranged_step.clone()
        };
        let text = prediction_lines(&alone);
        assert!(
            text.contains("): micro-batches back to back, where the trials waited"),
            "{text}"
        );
        assert!(!text.contains(":;"), "{text}");
        let text = prediction_lines(&accumulated(MicroBatches::FromTrialSteps, true));
        assert!(
            text.contains("where the work may take over; with micro-batches, up to as many steps"),
            "{text}"
        );
        assert!(!text.contains("back to back"), "{text}");
        // A number says nothing about a range.
        let point = Prediction {
            step_time: crate::fit::estimate::StepTime {
                low: 0.0475,
                high: 0.0475,
                launch_bound: false,
                ..accumulated(MicroBatches::FromTrialSteps, false).step_time
            },
            step_seconds: 0.0475,
            ..ranged_step.clone()
        };
        let text = prediction_lines(&point);
        assert!(
            text.starts_with("predicted step time 47.5 ms (micro-batch "),
            "{text}"
        );
        assert!(!text.contains("micro-batches"), "{text}");
        assert!(!prediction_lines(&ranged_step).contains("micro-batches"));

        // A range from the allocator's rules says which of their reasons made it.
        for (source, why) in [
            (
                CacheSource::RulesMissedTrial,
                "missed the larger calibration trial's own peak",
            ),
            (
                CacheSource::RulesSegmentOrder,
                "where the device puts new segments, unknown ahead, and at this batch that \
                 changes the peak: a run's peak usually lands near one end or the other, and the \
                 point is off by the same percentage whichever it takes",
            ),
            (
                CacheSource::RulesFirstSteps,
                "split into micro-batches as the rewrite runs them they give one end, as the \
                 plain trials ran them the other",
            ),
            (
                CacheSource::RulesSegmentPlacement,
                "placed between them another peak, which a run may take",
            ),
        ] {
            let ranged = Prediction {
                cache_source: source,
                ..spread.clone()
            };
            let text = prediction_lines(&ranged);
            assert!(text.contains(why), "{source:?}: {text}");
        }

        // The GPU's work: in a profiled trial's row, and said where it is the point.
        let profiled = Trial {
            outcome: Outcome::Ran(Box::new(Measured {
                step_seconds: 0.038,
                gpu_busy_seconds: Some(0.018),
                ..measured.clone()
            })),
            ..trial.clone()
        };
        assert_eq!(trial_row(1, &profiled, "fits")[5], "38.0 ms (GPU 18.0)");
        assert_eq!(trial_row(1, &trial, "fits")[5], "42.0 ms");
        let at = |work: f64| {
            let mut p = prediction.clone();
            p.step_time.gpu_work = Some(work);
            p.step_seconds = 0.072;
            prediction_lines(&p)
        };
        let text = at(0.072);
        assert!(
            text.contains("the GPU's own work in a step at this batch: 72.0 ms"),
            "{text}"
        );
        assert!(text.contains("no faster than its GPU's work"), "{text}");
        assert!(!at(0.050).contains("no faster"), "{}", at(0.050));
        assert!(!prediction_lines(&prediction).contains("GPU"));
    }

    #[test]
    fn the_model_terms_say_what_is_left_and_what_the_rest_needs() {
        let fixed = Fixed {
            parameters: 1 << 30,
            gradients: 1 << 30,
            optimizer_state: 2 << 30,
        };
        let terms = ModelTerms {
            what: "the model in `vs` (cell [2])",
            fixed,
            frozen: 1 << 20,
            state: StateCounted::Rule("Adam"),
            device: Some((512 << 20, 80 << 30)),
            held: 0,
        };
        let display = model_terms_display(&terms);
        let text = display.data["text/plain"].as_str().unwrap();
        assert!(text.contains("(1.0 MiB of them frozen)"), "{text}");
        assert!(text.contains("Adam's rule"), "{text}");
        assert!(text.contains("CUDA context"), "{text}");
        assert!(!text.contains("other tensors"), "{text}");
        // 4 GiB + 1 MiB + 512 MiB of 80 GiB.
        assert!(text.contains("75.5 GiB is left"), "{text}");
        let json = &display.data[ESTIMATE_MIME];
        assert_eq!(json["parameters"], (1u64 << 30) + (1 << 20));
        // What else the notebook holds on the device (a style transfer's frozen network and
        // images) is there through training: it leaves that much less.
        let holding = model_terms_display(&ModelTerms {
            held: 1 << 30,
            ..terms
        });
        let text = holding.data["text/plain"].as_str().unwrap();
        assert!(
            text.contains("  other tensors       1.0 GiB   on the device already"),
            "{text}"
        );
        assert!(text.contains("74.5 GiB is left"), "{text}");
        assert_eq!(holding.data[ESTIMATE_MIME]["held"], 1u64 << 30);
        let cpu = model_terms_display(&ModelTerms {
            state: StateCounted::NoOptimizer,
            device: None,
            ..terms
        });
        let text = cpu.data["text/plain"].as_str().unwrap();
        assert!(
            text.contains("No CUDA device") && text.contains("--optimizer NAME"),
            "{text}"
        );
        assert!(!text.contains("CUDA context"), "{text}");
        assert!(cpu.data[ESTIMATE_MIME]["optimizer_state"].is_u64());
        // An optimizer the notebook wrote: its state is not counted, and the total says so.
        let unread = model_terms_display(&ModelTerms {
            fixed: Fixed {
                optimizer_state: 0,
                ..fixed
            },
            state: StateCounted::Unread("`opt` (a `SparseAdam`, built in cell [4])"),
            device: None,
            ..terms
        });
        let text = unread.data["text/plain"].as_str().unwrap();
        assert!(
            text.contains("optimizer state  not counted  `opt` (a `SparseAdam`"),
            "{text}"
        );
        assert!(text.contains("without the optimizer's state"), "{text}");
        assert!(unread.data[ESTIMATE_MIME]["optimizer_state"].is_null());
        let trial = fixed_terms_display("batch = 8", &fixed, Some("`opt` (a `SparseAdam`)"));
        let text = trial.data["text/plain"].as_str().unwrap();
        assert!(
            text.contains("not counted: no rule counts the state of `opt` (a `SparseAdam`)"),
            "{text}"
        );
        assert!(trial.data[ESTIMATE_MIME]["optimizer_state"].is_null());
        let known = fixed_terms_display("batch = 8", &fixed, None);
        assert_eq!(known.data[ESTIMATE_MIME]["optimizer_state"], 2u64 << 30);
    }
}
