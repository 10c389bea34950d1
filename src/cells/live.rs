//! The live view under a running cell: the child's samples ([`CellOutput::Live`]) become one
//! display per run, updated in place at most four times a second, and a last line once the run
//! ends (see `report::live`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tchmem_wire::Display;

use crate::report::live::LiveState;
use crate::session::{CellOutput, OutputSink};

/// Display ids of live views start with this (`tchmem execute` prints them on stderr).
pub const DISPLAY_ID_PREFIX: &str = "tchmem-live-";

/// At most this often an update is sent.
const MIN_UPDATE_GAP: Duration = Duration::from_millis(250);

/// Whether `output` is a live view's display (or a sample for one).
pub fn is_live_view(output: &CellOutput) -> bool {
    match output {
        CellOutput::Live(_) => true,
        CellOutput::Display(display) => display
            .display_id
            .as_deref()
            .is_some_and(|id| id.starts_with(DISPLAY_ID_PREFIX)),
        _ => false,
    }
}

#[derive(Default)]
struct View {
    state: LiveState,
    shown: bool,
    last_sent: Option<Instant>,
}

/// One run's live view, in front of the output sink it shows on.
pub struct LiveView {
    id: String,
    view: Arc<Mutex<View>>,
    output: OutputSink,
}

impl LiveView {
    /// A view for one run whose outputs go to `output`; `label` says which run of a magic it is.
    /// Returns the sink to run the cell with: samples become the view, the rest passes.
    pub fn wrap(output: OutputSink, label: Option<String>) -> (LiveView, OutputSink) {
        static VIEWS: AtomicU64 = AtomicU64::new(0);
        let id = format!(
            "{DISPLAY_ID_PREFIX}{}-{}",
            std::process::id(),
            VIEWS.fetch_add(1, Ordering::Relaxed)
        );
        let view = Arc::new(Mutex::new(View {
            state: LiveState {
                label,
                ..Default::default()
            },
            ..Default::default()
        }));
        let (sink_view, sink_output, sink_id) =
            (Arc::clone(&view), Arc::clone(&output), id.clone());
        let sink: OutputSink = Arc::new(move |out| match out {
            CellOutput::Live(sample) => {
                let mut view = lock(&sink_view);
                view.state.push(sample);
                let due = view
                    .last_sent
                    .is_none_or(|sent| sent.elapsed() >= MIN_UPDATE_GAP);
                if due {
                    let display = Display {
                        data: view.state.bundle(false),
                        display_id: Some(sink_id.clone()),
                        update: view.shown,
                        ..Default::default()
                    };
                    view.shown = true;
                    view.last_sent = Some(Instant::now());
                    sink_output(CellOutput::Display(display));
                }
            }
            other => sink_output(other),
        });
        (LiveView { id, view, output }, sink)
    }

    /// The run ended: a view that was shown becomes its last line (the record follows as usual).
    pub fn finish(self) {
        let view = lock(&self.view);
        if !view.shown {
            return;
        }
        (self.output)(CellOutput::Display(Display {
            data: view.state.bundle(true),
            display_id: Some(self.id.clone()),
            update: true,
            ..Default::default()
        }));
    }
}

fn lock(view: &Mutex<View>) -> std::sync::MutexGuard<'_, View> {
    view.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tchmem_wire::progress::LiveSample;

    fn collect() -> (OutputSink, Arc<Mutex<Vec<CellOutput>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&seen);
        (Arc::new(move |out| kept.lock().unwrap().push(out)), seen)
    }

    #[test]
    fn samples_become_one_display_updated_in_place_then_a_last_line() {
        let (output, seen) = collect();
        let (view, sink) = LiveView::wrap(output, Some("trial 2".into()));
        for elapsed in [1.0, 1.01, 1.02] {
            sink(CellOutput::Live(LiveSample {
                elapsed,
                ..Default::default()
            }));
        }
        std::thread::sleep(MIN_UPDATE_GAP);
        sink(CellOutput::Live(LiveSample {
            elapsed: 1.3,
            ..Default::default()
        }));
        sink(CellOutput::ClearOutput { wait: false });
        view.finish();
        let seen = seen.lock().unwrap();
        let displays: Vec<&Display> = seen
            .iter()
            .filter_map(|o| match o {
                CellOutput::Display(d) => Some(d),
                _ => None,
            })
            .collect();
        assert_eq!(
            displays.len(),
            3,
            "one, one update past the gap, the last line"
        );
        assert!(!displays[0].update && displays[1].update && displays[2].update);
        let id = displays[0].display_id.clone().unwrap();
        assert!(id.starts_with(DISPLAY_ID_PREFIX));
        assert!(displays.iter().all(|d| d.display_id.as_ref() == Some(&id)));
        let last = displays[2].data["text/plain"].as_str().unwrap();
        assert!(last.starts_with("ran 1.3 s · trial 2"), "{last}");
        assert!(seen
            .iter()
            .any(|o| matches!(o, CellOutput::ClearOutput { .. })));
    }

    #[test]
    fn a_short_run_shows_nothing() {
        let (output, seen) = collect();
        let (view, _sink) = LiveView::wrap(output, None);
        view.finish();
        assert!(seen.lock().unwrap().is_empty());
    }
}
