//! Command line: `tchmem kernel | install | execute | prepare | chart | timeline`.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use crate::engine::{workdir, Engine, EngineConfig};

/// A Jupyter kernel for Rust notebooks on tch (libtorch) that shows where GPU memory goes.
#[derive(Parser)]
#[command(version, about, long_about = None)]
pub struct Cli {
    /// More log output on stderr (-v debug, -vv trace); RUST_LOG overrides it.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the kernel for a Jupyter frontend (this is what kernel.json starts).
    Kernel {
        /// The connection file written by Jupyter.
        #[arg(short = 'f', long)]
        connection_file: PathBuf,
        #[command(flatten)]
        engine: EngineArgs,
    },
    /// Install the kernelspec so that Jupyter offers "Rust (tchmem)".
    Install(crate::install::InstallArgs),
    /// Run a notebook headless through the same engine and write it back with its outputs.
    Execute {
        /// The notebook to run (nbformat 4).
        notebook: PathBuf,
        /// Where to write the executed notebook [default: overwrite NOTEBOOK].
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Run every cell even after one fails (the exit status still reports the failure).
        #[arg(long)]
        allow_errors: bool,
        #[command(flatten)]
        engine: EngineArgs,
    },
    /// Build a compile slot (tch, torch-sys and the runtime, compiled for cells) so that the next
    /// kernel starts in seconds. scripts/setup and offline installs run it; it is quick when the
    /// slot is already built.
    Prepare {
        #[command(flatten)]
        engine: EngineArgs,
    },
    /// Draw a memory record (application/vnd.tchmem.record+json, as a file) as the SVG chart
    /// the kernel shows under a cell.
    Chart {
        /// The record, as JSON.
        record: PathBuf,
        /// Where to write the SVG.
        #[arg(short, long)]
        output: PathBuf,
        /// Title of the chart [default: "<device> after the cell"].
        #[arg(long)]
        title: Option<String>,
    },
    /// Draw an allocation timeline (a capture, application/vnd.tchmem.timeline+json, as a
    /// file, with its snapshot pickle beside it or where it says) as the SVG the kernel shows
    /// under a %%memprofile cell, and print it in words.
    Timeline {
        /// The capture, as JSON.
        capture: PathBuf,
        /// Where to write the SVG.
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// Also copy the snapshot (PyTorch's memory_viz pickle) to PATH.
        #[arg(long, value_name = "PATH")]
        snapshot: Option<PathBuf>,
    },
}

/// Options shared by the commands that run cells.
#[derive(Args)]
struct EngineArgs {
    /// libtorch to use [default: $LIBTORCH, else torch in the project venv, else python3's torch].
    #[arg(long, value_name = "DIR")]
    libtorch: Option<PathBuf>,
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Kernel {
            connection_file,
            engine,
        } => {
            let (engine, _workdir) = start_engine(&engine, true)?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .context("cannot start the async runtime")?;
            runtime.block_on(crate::kernel::serve(&connection_file, engine.clone()))?;
            engine.stop_child();
            // Blocking tasks (a pending input request) must not hold the exit.
            runtime.shutdown_timeout(std::time::Duration::from_millis(200));
            Ok(())
        }
        Command::Install(args) => crate::install::install(&args),
        Command::Prepare { engine } => prepare(&engine),
        Command::Chart {
            record,
            output,
            title,
        } => chart(&record, &output, title.as_deref()),
        Command::Timeline {
            capture,
            output,
            snapshot,
        } => timeline(&capture, output.as_deref(), snapshot.as_deref()),
        Command::Execute {
            notebook,
            output,
            allow_errors,
            engine,
        } => {
            let cells = crate::notebook::load(&notebook)?;
            let (engine, _workdir) = start_engine(&engine, false)?;
            let output = output.unwrap_or_else(|| notebook.clone());
            let result = crate::notebook::execute(&engine, cells, &output, allow_errors);
            engine.stop_child();
            result
        }
    }
}

/// Starts the engine (which builds the slot if needed) and runs one cell that uses tch and the
/// runtime, so that a failure to build them is reported here rather than in a user's cell.
fn prepare(args: &EngineArgs) -> anyhow::Result<()> {
    use crate::engine::{CellIo, CellOutput};
    let started = std::time::Instant::now();
    let (engine, workdir) = start_engine(args, false)?;
    crate::notebook::wait_for_engine(&engine);
    let io = CellIo {
        output: std::sync::Arc::new(|output| {
            if let CellOutput::Stream(_, text) = output {
                eprint!("{text}");
            }
        }),
        input: None,
    };
    let cell = "let _ = (tchmem::version(), tch::Tensor::from(1i64));".to_string();
    let outcome = engine
        .execute(cell, io)
        .blocking_recv()
        .context("the engine stopped")?;
    // The paths the first completions ask for, so that a start after set-up answers at once.
    if outcome.error.is_none() {
        engine
            .remember_paths()
            .blocking_recv()
            .context("the engine stopped")?;
    }
    engine.stop_child();
    if let Some(error) = outcome.error {
        anyhow::bail!(
            "the compile slot {} could not build tch and the runtime: {}: {}\n{}",
            workdir.path.display(),
            error.ename,
            error.evalue,
            error.traceback.join("\n")
        );
    }
    println!(
        "compile slot {} ready in {:.1} s",
        workdir.path.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn chart(
    record: &std::path::Path,
    output: &std::path::Path,
    title: Option<&str>,
) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(record)
        .with_context(|| format!("cannot read {}", record.display()))?;
    let record: tchmem_wire::memory::MemoryRecord = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a tchmem memory record", record.display()))?;
    let svg = crate::report::chart_svg(&record, title).map_err(|e| anyhow::anyhow!(e))?;
    std::fs::write(output, svg).with_context(|| format!("cannot write {}", output.display()))?;
    Ok(())
}

fn timeline(
    capture_path: &std::path::Path,
    output: Option<&std::path::Path>,
    snapshot: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(capture_path)
        .with_context(|| format!("cannot read {}", capture_path.display()))?;
    let mut capture: tchmem_wire::timeline::TimelineCapture = serde_json::from_str(&text)
        .with_context(|| {
            format!(
                "{} is not a tchmem timeline capture",
                capture_path.display()
            )
        })?;
    // A capture moved from the machine that recorded it: its pickle sits beside it.
    if !std::path::Path::new(&capture.snapshot).exists() {
        capture.snapshot = capture_path.with_extension("pickle").display().to_string();
    }
    let started = std::time::Instant::now();
    let snapshot_data = crate::timeline::snapshot::read(&capture.snapshot)?;
    let read = started.elapsed().as_secs_f64();
    let timeline = crate::timeline::model::build(snapshot_data, &capture);
    let sources = crate::timeline::sites::CellSources::default();
    let title = format!("allocation timeline ({})", capture_path.display());
    let svg = crate::report::timeline::svg(&timeline, &sources, &title)
        .map_err(|e| anyhow::anyhow!(e))?;
    let drawn = started.elapsed().as_secs_f64() - read;
    eprintln!(
        "{} trace entries: pickle read in {read:.3} s, timeline built and drawn in {drawn:.3} s \
         as {} bytes of SVG",
        timeline.entries.len(),
        svg.len()
    );
    print!(
        "{}",
        crate::report::timeline::text(&timeline, &sources, &title)
    );
    if let Some(output) = output {
        std::fs::write(output, svg)
            .with_context(|| format!("cannot write {}", output.display()))?;
    }
    if let Some(path) = snapshot {
        std::fs::copy(&capture.snapshot, path)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// Prepares the process environment and starts the engine thread. The returned workdir lock
/// must live as long as the engine.
fn start_engine(
    args: &EngineArgs,
    warm_up_analysis: bool,
) -> anyhow::Result<(Engine, workdir::Workdir)> {
    let root = std::env::var_os("TCHMEM_WORKDIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::libtorch::cache_dir().join("evcxr"));
    let workdir = workdir::acquire(root)?;
    let mut config = EngineConfig::discover(args.libtorch.as_deref(), workdir.path.clone());
    config.warm_up_analysis = warm_up_analysis;
    config.apply_to_process_environment();
    tracing::info!(
        "compiling cells in {} with libtorch {}",
        workdir.path.display(),
        config
            .libtorch
            .as_ref()
            .map_or("(none)".into(), |p| p.display().to_string())
    );
    Ok((Engine::start(config), workdir))
}
