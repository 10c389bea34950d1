//! The engine's start, as a user waiting on it sees it: compiling the prelude (tch, torch-sys and
//! the runtime) into a compile slot takes seconds in a prepared slot and minutes in a new one.
//!
//! Cargo's own progress goes to evcxr, which keeps it to itself; the slot's target directory is
//! watched instead: every unit cargo builds leaves a fingerprint directory there. A successful
//! start writes the count beside the slots, so that later new slots show "N of M".

use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tchmem_wire::Display;

use crate::session::{CellOutput, OutputSink};

/// Written beside the slots after a prelude build: how many units a full one made.
const UNITS_FILE: &str = "prelude-units";

/// Where the engine's start stands.
#[derive(Debug, Clone, PartialEq)]
pub enum Stage {
    /// The prelude is compiling (or loading).
    Starting,
    /// The engine takes cells; the prelude took this long.
    Ready(Duration),
}

/// Shared between the engine thread, which starts the session, and whoever waits for it.
pub struct Startup {
    slot: PathBuf,
    began: Instant,
    /// The same moment by the clock file times use: units changed since were built by this start.
    began_at: SystemTime,
    units_at_begin: usize,
    stage: Mutex<Stage>,
    changed: Condvar,
}

/// What a waiting user is told.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    /// Seconds since the engine began starting.
    pub seconds: f64,
    /// Units cargo built in this start so far.
    pub built: usize,
    /// Units a full prelude build makes, when an earlier build recorded it.
    pub expected: Option<usize>,
    /// The crate built last, when one was.
    pub latest: Option<String>,
}

impl Progress {
    /// One line: what happens, how far, since when.
    pub fn line(&self) -> String {
        if self.built == 0 {
            return format!(
                "Starting the kernel: loading tch and the tchmem runtime ({:.0} s)",
                self.seconds
            );
        }
        let of = self
            .expected
            .map_or(String::new(), |total| format!(" of ~{total}"));
        let latest = self
            .latest
            .as_ref()
            .map_or(String::new(), |name| format!(", last: {name}"));
        format!(
            "Starting the kernel: compiling tch, torch-sys and the tchmem runtime into a new \
             compile slot (a first start with this libtorch, or another kernel holds the \
             prepared slot): {}{of} crates built{latest} ({:.0} s; `tchmem prepare` does this \
             ahead of time)",
            self.built, self.seconds
        )
    }
}

impl Startup {
    /// A start of the engine compiling in `slot`, beginning now.
    pub fn begin(slot: PathBuf) -> Startup {
        let units_at_begin = units(&slot).len();
        Startup {
            slot,
            began: Instant::now(),
            // File times come from the kernel's coarse clock, a tick behind this one.
            began_at: SystemTime::now() - Duration::from_millis(100),
            units_at_begin,
            stage: Mutex::new(Stage::Starting),
            changed: Condvar::new(),
        }
    }

    /// Marks the engine ready; records the full build's size when this start built the prelude.
    pub fn finish(&self, prelude_ok: bool) {
        let built = units(&self.slot).len();
        if prelude_ok && self.units_at_begin == 0 && built > 0 {
            if let Some(root) = self.slot.parent() {
                let _ = std::fs::write(root.join(UNITS_FILE), built.to_string());
            }
        }
        *self.stage.lock().unwrap_or_else(|e| e.into_inner()) = Stage::Ready(self.began.elapsed());
        self.changed.notify_all();
    }

    /// The stage now.
    pub fn stage(&self) -> Stage {
        self.stage.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits up to `timeout` for the engine to be ready; returns the stage then.
    pub fn wait(&self, timeout: Duration) -> Stage {
        let stage = self.stage.lock().unwrap_or_else(|e| e.into_inner());
        let (stage, _) = self
            .changed
            .wait_timeout_while(stage, timeout, |stage| *stage == Stage::Starting)
            .unwrap_or_else(|e| e.into_inner());
        stage.clone()
    }

    /// How far the start has come: units built (or rebuilt, e.g. a changed runtime) since it
    /// began.
    pub fn progress(&self) -> Progress {
        let fresh: Vec<(String, SystemTime)> = units(&self.slot)
            .into_iter()
            .filter(|unit| unit.1 >= self.began_at)
            .collect();
        let latest = fresh
            .iter()
            .max_by_key(|unit| unit.1)
            .map(|unit| unit.0.clone());
        let expected = self
            .slot
            .parent()
            .and_then(|root| std::fs::read_to_string(root.join(UNITS_FILE)).ok())
            .and_then(|text| text.trim().parse().ok());
        Progress {
            seconds: self.began.elapsed().as_secs_f64(),
            built: fresh.len(),
            expected,
            latest,
        }
    }

    /// Calls `report` with the progress every `every` until the engine is ready; returns the
    /// progress at the end (how much this start built, and how long it took).
    pub fn report_until_ready(
        &self,
        every: Duration,
        mut report: impl FnMut(&Progress),
    ) -> Progress {
        while self.wait(every) == Stage::Starting {
            report(&self.progress());
        }
        self.progress()
    }
}

/// How often a waiting cell's progress display is updated.
const DISPLAY_EVERY: Duration = Duration::from_secs(1);

/// Shows the start's progress under a cell that waits for it, as one display updated in place;
/// returns when the engine is ready. A start that compiled something leaves a line saying
/// what it built; a start that only loaded clears its display.
pub fn show_until_ready(startup: &Startup, output: &OutputSink) {
    let id = format!("tchmem-startup-{}", uuid::Uuid::new_v4());
    let mut shown = false;
    let last = startup.report_until_ready(DISPLAY_EVERY, |progress| {
        output(CellOutput::Display(progress_display(progress, &id, shown)));
        shown = true;
    });
    if !shown {
        return;
    }
    if last.built > 0 {
        let done = Progress {
            latest: None,
            ..last
        };
        let line = format!(
            "Kernel ready: {} crates compiled into a new compile slot in {:.0} s; the next \
             start reuses it.",
            done.built, done.seconds
        );
        output(CellOutput::Display(text_display(&line, None, &id, true)));
    } else {
        output(CellOutput::ClearOutput { wait: false });
    }
}

fn progress_display(progress: &Progress, id: &str, update: bool) -> Display {
    let bar = progress.expected.map(|total| {
        format!(
            "<progress value='{}' max='{total}' style='width:20em'></progress>",
            progress.built.min(total)
        )
    });
    text_display(&progress.line(), bar, id, update)
}

fn text_display(line: &str, extra_html: Option<String>, id: &str, update: bool) -> Display {
    let mut data = serde_json::Map::new();
    data.insert("text/plain".into(), line.into());
    data.insert(
        "text/html".into(),
        format!(
            "<div class='tchmem-startup'>{}<div>{}</div></div>",
            extra_html.unwrap_or_default(),
            crate::report::escape(line)
        )
        .into(),
    );
    Display {
        data,
        metadata: Default::default(),
        display_id: Some(id.to_string()),
        update,
    }
}

/// The dependency units cargo has built in `slot` (host and target), each with its crate name
/// and when it was built. The cells' own crates are left out.
fn units(slot: &Path) -> Vec<(String, SystemTime)> {
    let target = slot.join("target");
    let Ok(entries) = std::fs::read_dir(&target) else {
        return Vec::new();
    };
    // target/debug (build scripts, host) and target/<triple>/debug (everything cells link).
    let profiles = entries
        .flatten()
        .map(|entry| entry.path())
        .flat_map(|dir| [dir.join(".fingerprint"), dir.join("debug/.fingerprint")]);
    let mut found = Vec::new();
    for fingerprints in profiles {
        let Ok(units) = std::fs::read_dir(fingerprints) else {
            continue;
        };
        for unit in units.flatten() {
            let name = unit.file_name().to_string_lossy().to_string();
            // `<crate>-<16 hex digits>`
            let crate_name = name.rsplit_once('-').map_or(name.as_str(), |(n, _)| n);
            if crate_name == "ctx" || crate_name.starts_with("code_") {
                continue;
            }
            let built = unit
                .metadata()
                .and_then(|m| m.modified())
                .unwrap_or(SystemTime::UNIX_EPOCH);
            found.push((crate_name.to_string(), built));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(slot: &Path, triple: &str, name: &str) {
        let dir = if triple.is_empty() {
            slot.join("target/debug/.fingerprint")
        } else {
            slot.join("target").join(triple).join("debug/.fingerprint")
        };
        std::fs::create_dir_all(dir.join(name)).unwrap();
    }

    #[test]
    fn progress_counts_the_units_built_since_the_start_and_learns_the_total() {
        let root = std::env::temp_dir().join(format!("tchmem-startup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let slot = root.join("slot-0");
        std::fs::create_dir_all(&slot).unwrap();

        unit(&slot, "", "built-before-0123456789abcdef");
        std::thread::sleep(Duration::from_millis(300));
        let startup = Startup::begin(slot.clone());
        assert_eq!(startup.progress().built, 0);
        assert!(startup
            .progress()
            .line()
            .starts_with("Starting the kernel: loading"));
        unit(&slot, "", "torch-sys-0123456789abcdef");
        unit(&slot, "x86_64-unknown-linux-gnu", "tch-0123456789abcdef");
        unit(&slot, "x86_64-unknown-linux-gnu", "ctx-0123456789abcdef");
        let progress = startup.progress();
        assert_eq!(progress.built, 2);
        assert_eq!(progress.expected, None);
        assert!(
            progress.line().contains("2 crates built"),
            "{}",
            progress.line()
        );
        assert_eq!(startup.stage(), Stage::Starting);

        // Only a start into an empty slot records the total; this one found a unit there.
        startup.finish(true);
        assert!(matches!(startup.wait(Duration::ZERO), Stage::Ready(_)));
        assert!(!root.join(UNITS_FILE).exists());
        std::fs::write(root.join(UNITS_FILE), "2").unwrap();
        // A later new slot knows how many units to expect.
        let next = Startup::begin(root.join("slot-1"));
        unit(&root.join("slot-1"), "", "cc-0123456789abcdef");
        let line = next.progress().line();
        assert!(line.contains("1 of ~2 crates built, last: cc"), "{line}");
        // A prepared slot builds nothing: a restart does not overwrite the total.
        let again = Startup::begin(root.join("slot-1"));
        again.finish(true);
        assert_eq!(std::fs::read_to_string(root.join(UNITS_FILE)).unwrap(), "2");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
