//! The live view under a running cell: a line of text (also what `tchmem execute` prints on
//! stderr) and HTML with a small curve of the device's memory over the cell's wall time.

use std::collections::VecDeque;

use plotters::prelude::*;
use serde_json::{Map, Value};
use tchmem_wire::mime::LIVE_MIME;
use tchmem_wire::progress::{grouped, LiveSample, MemoryNow, Progress};

use super::chart::font;
use super::format::human_bytes;

/// The rate is measured over this many seconds of samples.
const RATE_WINDOW: f64 = 5.0;

/// How many points of the memory curve are kept (older ones are thinned out).
pub const MAX_POINTS: usize = 240;

/// What the view shows: the samples so far, reduced to what is drawn.
#[derive(Debug, Clone, Default)]
pub struct LiveState {
    /// Which run it is, for a magic's trials and comparisons (`None` for a plain cell).
    pub label: Option<String>,
    /// `(seconds, allocated, reserved)` over the cell's wall time.
    pub points: Vec<(f64, u64, u64)>,
    /// The last sample.
    pub last: LiveSample,
    /// `(seconds, steps)` of the step counter over the last few seconds, for the rate.
    pub recent_steps: VecDeque<(f64, u64)>,
}

/// The counter the view calls steps: what the loop reported, else the optimizer steps the
/// runtime marked, else the iterations of the loop that turned most often.
#[derive(Debug, Clone, PartialEq)]
pub struct Steps {
    /// What is counted ("step", "optimizer step", "iteration").
    pub noun: &'static str,
    /// Of what, when it needs saying (" of the loop at line 14").
    pub of: String,
    /// How many so far.
    pub count: u64,
    /// Out of how many, when the loop said.
    pub total: Option<u64>,
}

/// The step counter of `progress` (see [`Steps`]).
pub fn steps(progress: &Progress) -> Option<Steps> {
    if let Some(count) = progress.step {
        return Some(Steps {
            noun: "step",
            of: String::new(),
            count,
            total: progress.total,
        });
    }
    if progress.optimizer_steps > 0 {
        return Some(Steps {
            noun: "optimizer step",
            of: String::new(),
            count: progress.optimizer_steps,
            total: None,
        });
    }
    let busiest = progress.loops.iter().max_by_key(|l| l.iterations)?;
    Some(Steps {
        noun: "iteration",
        of: format!(" of {}", busiest.name()),
        count: busiest.iterations,
        total: None,
    })
}

impl LiveState {
    /// Takes a new sample in.
    pub fn push(&mut self, sample: LiveSample) {
        if let Some(memory) = &sample.memory {
            self.points
                .push((sample.elapsed, memory.allocated, memory.reserved));
            if self.points.len() > MAX_POINTS {
                // Every other point of the older half goes: the curve keeps its shape.
                let half = self.points.len() / 2;
                let mut index = 0;
                self.points.retain(|_| {
                    index += 1;
                    index > half || index % 2 == 0
                });
            }
        }
        if let Some(steps) = steps(&sample.progress) {
            // A counter that went back (another counter took over) starts the window again.
            if self
                .recent_steps
                .back()
                .is_some_and(|&(_, n)| n > steps.count)
            {
                self.recent_steps.clear();
            }
            self.recent_steps.push_back((sample.elapsed, steps.count));
            while self
                .recent_steps
                .front()
                .is_some_and(|&(t, _)| sample.elapsed - t > RATE_WINDOW)
            {
                self.recent_steps.pop_front();
            }
        }
        self.last = sample;
    }

    /// Steps per second over the last [`RATE_WINDOW`] seconds (at least one second of them).
    pub fn rate(&self) -> Option<f64> {
        let (&(since, from), &(until, now)) =
            (self.recent_steps.front()?, self.recent_steps.back()?);
        let seconds = until - since;
        (seconds >= 1.0 && now > from).then(|| (now - from) as f64 / seconds)
    }

    /// The view as one line of text.
    pub fn line(&self, finished: bool) -> String {
        let mut parts = Vec::new();
        let verb = if finished { "ran" } else { "running" };
        parts.push(format!("{verb} {}", seconds(self.last.elapsed)));
        if let Some(label) = &self.label {
            parts.push(label.clone());
        }
        if let Some(steps) = steps(&self.last.progress) {
            parts.push(self.steps_text(&steps, finished));
        }
        if let Some(loss) = self.last.progress.loss {
            parts.push(format!("loss {loss:.4}"));
        }
        match &self.last.memory {
            Some(memory) => parts.push(memory_text(memory)),
            None => parts.push("memory curves need CUDA".into()),
        }
        parts.join(" · ")
    }

    fn steps_text(&self, steps: &Steps, finished: bool) -> String {
        let mut text = match steps.total {
            Some(total) => format!(
                "{} {}/{}{} {}",
                steps.noun,
                grouped(steps.count),
                grouped(total),
                steps.of,
                bar(steps.count, total)
            ),
            None => format!("{} {}{}", steps.noun, grouped(steps.count), steps.of),
        };
        if let Some(rate) = self.rate() {
            text.push_str(&format!(" ({rate:.1}/s"));
            if let (Some(total), false) = (steps.total, finished) {
                let left = total.saturating_sub(steps.count) as f64 / rate;
                text.push_str(&format!(", {} left", seconds(left)));
            }
            text.push(')');
        }
        text
    }

    /// The view as a Jupyter bundle: text and HTML with the memory curve.
    pub fn bundle(&self, finished: bool) -> Map<String, Value> {
        let line = self.line(finished);
        let mut html = format!(
            "<div class=\"tchmem-live\" style=\"font-family:monospace;font-size:13px\">{}</div>",
            super::escape(&line)
        );
        if !finished {
            if let Some(svg) = self.curve() {
                html.push_str(&super::embed::image(&svg, "memory over the run"));
            }
        }
        let mut data = Map::new();
        data.insert("text/plain".into(), Value::String(line));
        data.insert("text/html".into(), Value::String(html));
        // The numbers behind the view, for tools and tests.
        if let Ok(sample) = serde_json::to_value(&self.last) {
            data.insert(LIVE_MIME.into(), sample);
        }
        data
    }

    /// Allocated and reserved bytes over the cell's wall time (SVG), once there are two points.
    fn curve(&self) -> Option<String> {
        if self.points.len() < 2 {
            return None;
        }
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (480, 130)).into_drawing_area();
            root.fill(&WHITE).ok()?;
            let end = self.points.last()?.0.max(1.0);
            let start = self.points.first()?.0.min(end - 0.5);
            let top = self.points.iter().map(|p| p.2.max(p.1)).max()?.max(1) as f64 * 1.1;
            let gib = |bytes: u64| bytes as f64 / f64::from(1 << 30);
            let mut chart = ChartBuilder::on(&root)
                .margin(6)
                .x_label_area_size(22)
                .y_label_area_size(56)
                .build_cartesian_2d(start..end, 0.0..top / f64::from(1 << 30))
                .ok()?;
            chart
                .configure_mesh()
                .x_labels(5)
                .y_labels(4)
                .x_label_formatter(&|s| format!("{s:.0} s"))
                .y_label_formatter(&|g| format!("{g:.2} GiB"))
                .label_style(font(11.0))
                .light_line_style(WHITE)
                .draw()
                .ok()?;
            let reserved = RGBColor(158, 158, 158);
            let allocated = RGBColor(66, 133, 244);
            chart
                .draw_series(LineSeries::new(
                    self.points.iter().map(|p| (p.0, gib(p.2))),
                    reserved.stroke_width(2),
                ))
                .ok()?
                .label("reserved")
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], reserved));
            chart
                .draw_series(LineSeries::new(
                    self.points.iter().map(|p| (p.0, gib(p.1))),
                    allocated.stroke_width(2),
                ))
                .ok()?
                .label("allocated")
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], allocated));
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .label_font(font(11.0))
                .background_style(WHITE.mix(0.8))
                .draw()
                .ok()?;
            root.present().ok()?;
        }
        Some(svg)
    }
}

fn memory_text(memory: &MemoryNow) -> String {
    format!(
        "allocated {} (peak {}), reserved {} (peak {}) of {}",
        human_bytes(memory.allocated),
        human_bytes(memory.peak_allocated),
        human_bytes(memory.reserved),
        human_bytes(memory.peak_reserved),
        human_bytes(memory.capacity)
    )
}

/// A ten-character bar for `count` of `total`.
fn bar(count: u64, total: u64) -> String {
    let filled = (u128::from(count.min(total)) * 10)
        .checked_div(u128::from(total))
        .unwrap_or(0) as usize;
    format!("[{}{}]", "#".repeat(filled), ".".repeat(10 - filled))
}

/// `12.3 s`, `4 min 05 s`, `1 h 02 min`.
fn seconds(s: f64) -> String {
    let whole = s.max(0.0) as u64;
    match whole {
        0..=59 => format!("{s:.1} s"),
        60..=3599 => format!("{} min {:02} s", whole / 60, whole % 60),
        _ => format!("{} h {:02} min", whole / 3600, whole % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tchmem_wire::progress::LoopCount;

    fn sample(elapsed: f64, iterations: u64, memory: Option<MemoryNow>) -> LiveSample {
        LiveSample {
            elapsed,
            memory,
            progress: Progress {
                loops: vec![
                    LoopCount {
                        line: 3,
                        function: None,
                        iterations: 1,
                    },
                    LoopCount {
                        line: 5,
                        function: None,
                        iterations,
                    },
                ],
                ..Default::default()
            },
        }
    }

    #[test]
    fn counts_the_busiest_loop_and_its_rate_without_cuda() {
        let mut state = LiveState::default();
        state.push(sample(1.0, 100, None));
        state.push(sample(3.0, 1304, None));
        let line = state.line(false);
        assert!(
            line.starts_with("running 3.0 s · iteration 1,304 of the loop at line 5 (602.0/s)"),
            "{line}"
        );
        assert!(line.ends_with("memory curves need CUDA"), "{line}");
        assert!(state.curve().is_none(), "no curve without memory");
    }

    #[test]
    fn a_reported_step_gives_a_bar_and_the_time_left() {
        let mut state = LiveState::default();
        for (t, step) in [(1.0, 10), (2.0, 20)] {
            let mut s = sample(t, 0, None);
            s.progress.step = Some(step);
            s.progress.total = Some(100);
            s.progress.loss = Some(2.5);
            state.push(s);
        }
        let line = state.line(false);
        assert!(
            line.contains("step 20/100 [##........] (10.0/s, 8.0 s left) · loss 2.5000"),
            "{line}"
        );
    }

    #[test]
    fn memory_is_drawn_as_a_curve_and_thinned_out() {
        let mut state = LiveState::default();
        let gib = 1u64 << 30;
        for i in 0..(MAX_POINTS as u64 + 50) {
            state.push(sample(
                1.0 + i as f64 * 0.25,
                i,
                Some(MemoryNow {
                    allocated: gib + i,
                    reserved: 2 * gib,
                    peak_allocated: gib + i,
                    peak_reserved: 2 * gib,
                    capacity: 80 * gib,
                }),
            ));
        }
        assert!(state.points.len() <= MAX_POINTS);
        assert_eq!(
            state.points.last().map(|p| p.1),
            Some(gib + MAX_POINTS as u64 + 49)
        );
        let bundle = state.bundle(false);
        let html = bundle["text/html"].as_str().unwrap();
        let charts = crate::report::embed::svgs_in(html);
        assert!(
            charts.len() == 1 && charts[0].contains("allocated"),
            "{html}"
        );
        assert!(bundle["text/plain"]
            .as_str()
            .unwrap()
            .contains("of 80.0 GiB"));
        assert!(!state.bundle(true)["text/html"]
            .as_str()
            .unwrap()
            .contains("data:image/svg+xml"));
    }

    #[test]
    fn numbers_read_well() {
        assert_eq!(seconds(245.0), "4 min 05 s");
        assert_eq!(bar(5, 10), "[#####.....]");
        assert_eq!(bar(u64::MAX, u64::MAX), "[##########]");
    }
}
