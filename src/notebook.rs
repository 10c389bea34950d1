//! `tchmem execute`: runs a notebook's code cells in order through the engine and writes the
//! outputs back in nbformat 4, as a Jupyter frontend would have recorded them.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};

use crate::engine::{CellIo, CellOutcome, CellOutput, Engine, StreamName, LIVE_DISPLAY_ID_PREFIX};
use tchmem_wire::Display;

/// How often a running cell's progress is printed on stderr.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Outputs of one cell in nbformat 4 form, with where each display id went.
#[derive(Default)]
struct Outputs {
    list: Vec<Value>,
    by_display_id: HashMap<String, usize>,
    /// A `clear_output(wait=True)` is pending.
    clear_on_next: bool,
    /// When the live view was last printed on stderr.
    progress_printed: Option<Instant>,
}

impl Outputs {
    /// A live view's line goes to stderr every few seconds (and when its run ends), so that a
    /// long notebook run in a terminal shows where it is.
    fn print_progress(&mut self, display: &Display) {
        let live = display
            .display_id
            .as_deref()
            .is_some_and(|id| id.starts_with(LIVE_DISPLAY_ID_PREFIX));
        let Some(line) = display.data.get("text/plain").and_then(|v| v.as_str()) else {
            return;
        };
        let ended = line.starts_with("ran ");
        let due = self
            .progress_printed
            .is_none_or(|printed| printed.elapsed() >= PROGRESS_EVERY);
        if live && (due || ended) {
            eprintln!("tchmem: {line}");
            self.progress_printed = Some(Instant::now());
        }
    }

    fn clear(&mut self) {
        self.list.clear();
        self.by_display_id.clear();
        self.clear_on_next = false;
    }

    fn add(&mut self, output: CellOutput) {
        if self.clear_on_next && !matches!(output, CellOutput::ClearOutput { .. }) {
            self.clear();
        }
        match output {
            CellOutput::Stream(name, text) => {
                let name = match name {
                    StreamName::Stdout => "stdout",
                    StreamName::Stderr => "stderr",
                };
                // Consecutive text of one stream is one output, as Jupyter merges it.
                if let Some(last) = self.list.last_mut() {
                    if last["output_type"] == "stream" && last["name"] == name {
                        let joined = format!("{}{text}", last["text"].as_str().unwrap_or_default());
                        last["text"] = json!(joined);
                        return;
                    }
                }
                self.list
                    .push(json!({"output_type": "stream", "name": name, "text": text}));
            }
            CellOutput::ClearOutput { wait } => {
                if wait {
                    self.clear_on_next = true;
                } else {
                    self.clear();
                }
            }
            // The cells layer turns samples into the live view's displays.
            CellOutput::Live(_) => {}
            CellOutput::Display(display) => {
                self.print_progress(&display);
                let output = json!({
                    "output_type": "display_data",
                    "data": display.data,
                    "metadata": display.metadata,
                });
                let existing = display
                    .display_id
                    .as_ref()
                    .and_then(|id| self.by_display_id.get(id).copied());
                match existing {
                    Some(index) if display.update => self.list[index] = output,
                    _ if display.update => {} // updating a display this cell never showed
                    _ => {
                        if let Some(id) = display.display_id {
                            self.by_display_id.insert(id, self.list.len());
                        }
                        self.list.push(output);
                    }
                }
            }
        }
    }
}

/// Ctrl-C (SIGINT) while a notebook runs interrupts the running cell as the stop button would
/// (at its next loop boundary; a second Ctrl-C at once), and no further cell runs. The returned
/// flag says whether it came.
fn interrupt_on_ctrl_c(engine: &Engine) -> Arc<AtomicBool> {
    let pressed = Arc::new(AtomicBool::new(false));
    let (engine, flag) = (engine.clone(), Arc::clone(&pressed));
    let listening = std::thread::Builder::new()
        .name("ctrl-c".into())
        .spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async move {
                let kind = tokio::signal::unix::SignalKind::interrupt();
                let Ok(mut signals) = tokio::signal::unix::signal(kind) else {
                    return;
                };
                while signals.recv().await.is_some() {
                    flag.store(true, Ordering::SeqCst);
                    eprintln!(
                        "[tchmem] Ctrl-C: the running cell stops at its next loop boundary \
                         (Ctrl-C again stops it at once)"
                    );
                    engine.interrupt();
                }
            });
        });
    if let Err(error) = listening {
        eprintln!("[tchmem] Ctrl-C will end the run at once (no thread to catch it: {error})");
    }
    pressed
}

/// Reads and checks a notebook before any time is spent starting the engine.
pub fn load(path: &Path) -> anyhow::Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let notebook: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a notebook (invalid JSON)", path.display()))?;
    if notebook["nbformat"].as_u64() != Some(4) {
        bail!("{} is not an nbformat 4 notebook", path.display());
    }
    if !notebook["cells"].is_array() {
        bail!(
            "{} is not a notebook: it has no list of cells",
            path.display()
        );
    }
    Ok(notebook)
}

/// Runs the code cells of `notebook` (from [`load`]) and writes it with outputs to `output`.
/// Stops at the first failing cell unless `allow_errors`; a failure makes the result an error
/// either way, after the notebook is written. A cell tagged [`RAISES_EXCEPTION`] must fail: its
/// error is its output, and it failing to fail is the failure.
pub fn execute(
    engine: &Engine,
    mut notebook: Value,
    output: &Path,
    allow_errors: bool,
) -> anyhow::Result<()> {
    let cells = notebook["cells"].as_array_mut().context("no cells")?;
    wait_for_engine(engine);
    let ctrl_c = interrupt_on_ctrl_c(engine);

    let mut failures = Vec::new();
    let mut execution_count = 0;
    for (index, cell) in cells.iter_mut().enumerate() {
        if cell["cell_type"] != "code" {
            continue;
        }
        let code = source_text(&cell["source"]);
        let expects_error = has_tag(cell, RAISES_EXCEPTION);
        let stopped = ctrl_c.load(Ordering::SeqCst);
        if !stopped && (failures.is_empty() || allow_errors) {
            execution_count += 1;
            eprintln!("[tchmem] cell {}: running", index + 1);
            let started = chrono::Utc::now();
            let (mut outputs, mut outcome) = run_cell(engine, code);
            let finished = chrono::Utc::now();
            eprintln!(
                "[tchmem] cell {}: {} in {:.2} s",
                index + 1,
                match (&outcome.error, expects_error) {
                    (Some(_), true) => "failed as its tag expects",
                    (Some(_), false) => "failed",
                    (None, _) => "ok",
                },
                (finished - started).num_milliseconds() as f64 / 1000.0
            );
            // Where JupyterLab and nbclient record a cell's timing.
            cell["metadata"]["execution"] = json!({
                "shell.execute_reply.started": started.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                "shell.execute_reply": finished.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            });
            if outcome.error.is_none() && expects_error {
                failures.push(format!(
                    "cell {}: tagged {RAISES_EXCEPTION} but ran without an error",
                    index + 1
                ));
            }
            if let Some(error) = &outcome.error {
                if !expects_error {
                    failures.push(format!(
                        "cell {}: {}: {}",
                        index + 1,
                        error.ename,
                        error.evalue
                    ));
                }
                outputs.push(json!({
                    "output_type": "error",
                    "ename": error.ename.as_str(),
                    "evalue": error.evalue,
                    "traceback": error.traceback,
                }));
            } else if !outcome.data.is_empty() {
                let data = outcome.take_result();
                outputs.push(json!({
                    "output_type": "execute_result",
                    "execution_count": execution_count,
                    "data": data,
                    "metadata": {},
                }));
            }
            if let Some(display) = outcome.memory_display.take() {
                outputs.push(json!({
                    "output_type": "display_data",
                    "data": display.data,
                    "metadata": display.metadata,
                }));
            }
            if outcome.error.is_none() && !outcome.page.is_empty() {
                // Help for the pager (`:help`, a magic's --help): in a notebook, what JupyterLab
                // records for a `page` payload, after the cell's other outputs.
                outputs.push(json!({
                    "output_type": "display_data",
                    "data": outcome.take_page(),
                    "metadata": {},
                }));
            }
            cell["outputs"] = Value::Array(outputs);
            cell["execution_count"] = json!(execution_count);
            if ctrl_c.load(Ordering::SeqCst) {
                eprintln!("[tchmem] stopped by Ctrl-C: no further cell runs");
                failures.push(format!("cell {}: stopped by Ctrl-C", index + 1));
            }
        } else {
            cell["outputs"] = json!([]);
            cell["execution_count"] = Value::Null;
        }
    }
    notebook["metadata"]["kernelspec"] =
        json!({"name": "tchmem", "display_name": "Rust (tchmem)", "language": "rust"});
    notebook["metadata"]["language_info"] = json!({
        "name": "rust", "mimetype": "text/rust", "file_extension": ".rs",
        "pygments_lexer": "rust", "codemirror_mode": "rust",
    });
    std::fs::write(output, serde_json::to_string_pretty(&notebook)? + "\n")
        .with_context(|| format!("cannot write {}", output.display()))?;
    eprintln!("[tchmem] wrote {}", output.display());
    if !failures.is_empty() {
        bail!(
            "{} cell(s) failed:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    Ok(())
}

/// Waits for the engine's start, saying on stderr how far it is when it takes a while (a new
/// compile slot builds tch for minutes).
pub fn wait_for_engine(engine: &Engine) {
    let started = engine.report_start(std::time::Duration::from_secs(10), |progress| {
        eprintln!("[tchmem] {}", progress.line());
    });
    if started.built > 0 {
        eprintln!(
            "[tchmem] compiled {} crates into a new compile slot in {:.0} s",
            started.built, started.seconds
        );
    }
}

fn run_cell(engine: &Engine, code: String) -> (Vec<Value>, CellOutcome) {
    let outputs = Arc::new(Mutex::new(Outputs::default()));
    let sink = Arc::clone(&outputs);
    let io = CellIo {
        output: Arc::new(move |output| {
            sink.lock().unwrap_or_else(|e| e.into_inner()).add(output);
        }),
        input: None,
    };
    let outcome = engine
        .execute(code, io)
        .blocking_recv()
        .unwrap_or_else(|_| CellOutcome {
            error: Some(crate::engine::CellError::new(
                crate::cell_error::ErrorName::KernelError,
                "the engine stopped",
            )),
            ..Default::default()
        });
    let list = std::mem::take(&mut outputs.lock().unwrap_or_else(|e| e.into_inner()).list);
    (list, outcome)
}

/// The cell tag (nbclient's and nbconvert's) of a cell that is meant to fail, such as a
/// tutorial's error example.
pub const RAISES_EXCEPTION: &str = "raises-exception";

fn has_tag(cell: &Value, tag: &str) -> bool {
    cell["metadata"]["tags"]
        .as_array()
        .is_some_and(|tags| tags.iter().any(|t| t == tag))
}

/// nbformat stores source as a string or a list of lines.
fn source_text(source: &Value) -> String {
    match source {
        Value::String(text) => text.clone(),
        Value::Array(lines) => lines.iter().filter_map(Value::as_str).collect(),
        _ => String::new(),
    }
}
