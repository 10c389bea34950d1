//! The child of a `%%distributed` world: it runs no cells itself but starts one cell-running
//! child per rank and stands between them and evcxr.
//!
//! evcxr talks to it as to any child: every instruction (`LOAD_AND_RUN …`) goes to every rank;
//! while a cell runs, what evcxr writes (an answer to an input request) goes to rank 0 (the
//! other ranks' requests get an empty line). Each
//! rank's lines are routed by [`RankLines`]; the cell ends for evcxr once every rank ended it.
//! A rank that dies takes the world down (the others are stopped, and this process exits, which
//! evcxr reports as a crash and answers by starting a new world). A rank that panicked while
//! another still runs, after [`PANIC_GRACE`], likewise: the others are most likely waiting for
//! it in a collective, which would otherwise last the group's whole timeout.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use super::rank_lines::{report_block, RankLines, Routed, EXECUTION_COMPLETE, PANIC_NOTIFICATION};
use tchmem_wire::CellReport;
use tchmem_wire::MAX_RANKS;

/// Set on the world's child: how many ranks it starts.
pub const RANKS_ENV: &str = "TCHMEM_WORLD_RANKS";
/// How long the other ranks may still run after one panicked.
pub const PANIC_GRACE: Duration = Duration::from_secs(5);
/// How long a rank's stderr may lag its cell's completion line (the kernel waits as long for a
/// cell's stderr): then the rank counts as done without it.
pub const STDERR_GRACE: Duration = Duration::from_secs(5);

/// The ranks' process ids, for the signal handler (0: none).
static RANK_PIDS: [AtomicI32; MAX_RANKS] = [const { AtomicI32::new(0) }; MAX_RANKS];

/// How many ranks this process should start, when it is a world's child.
pub fn ranks_from_env() -> Option<usize> {
    let ranks = std::env::var(RANKS_ENV).ok()?.trim().parse().ok()?;
    (1..=MAX_RANKS).contains(&ranks).then_some(ranks)
}

/// What the launcher waits on.
enum Event {
    /// A line from evcxr.
    Instruction(String),
    /// evcxr closed our stdin: the kernel is done with the world.
    InstructionsEnded,
    /// A line a rank wrote.
    Line {
        rank: usize,
        stderr: bool,
        line: String,
    },
    /// A rank closed one of its streams (both closed: it ended).
    Closed { rank: usize },
}

/// A running rank.
struct Rank {
    process: Child,
    stdin: ChildStdin,
    lines: RankLines,
    /// Its stdout and stderr still open.
    open_streams: u8,
    /// When it printed the running cell's completion line.
    completed_at: Option<Instant>,
}

/// The launcher's state between events.
struct Launcher {
    world: Vec<Rank>,
    store: PathBuf,
    cell_running: bool,
    /// The first rank that panicked in the running cell, and when.
    first_panic: Option<(usize, Instant)>,
}

/// Runs the world's launcher until evcxr closes stdin; never returns.
pub fn run(ranks: usize) -> ! {
    // First: the kernel may signal a launcher it just (re)started.
    forward_signals();
    let store = store_path();
    let (events, received) = mpsc::channel();
    let mut launcher = Launcher {
        world: Vec::with_capacity(ranks),
        store,
        cell_running: false,
        first_panic: None,
    };
    for rank in 0..ranks {
        match start_rank(rank, ranks, &launcher.store, &events) {
            Ok(started) => launcher.world.push(started),
            Err(error) => {
                eprintln!("tchmem world: cannot start rank {rank} of {ranks}: {error}");
                launcher.stop(97);
            }
        }
    }
    read_instructions(events, launcher.store.clone());
    loop {
        let event = match launcher.deadline() {
            Some(at) => match received.recv_timeout(at.saturating_duration_since(Instant::now())) {
                Ok(event) => Some(event),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => launcher.stop(1),
            },
            None => match received.recv() {
                Ok(event) => Some(event),
                Err(_) => launcher.stop(1),
            },
        };
        match event {
            Some(event) => launcher.handle(event),
            None => launcher.past_deadline(),
        }
        if launcher.cell_running && launcher.world.iter().all(|rank| rank.lines.done()) {
            launcher.cell_running = false;
            launcher.first_panic = None;
            end_cell(&mut launcher.world);
        }
    }
}

impl Launcher {
    /// When the launcher must act without an event: the panic grace ends, or a rank that
    /// completed its cell has not ended its stderr within [`STDERR_GRACE`].
    fn deadline(&self) -> Option<Instant> {
        let panic = self.first_panic.map(|(_, at)| at + PANIC_GRACE);
        let stderr = self
            .world
            .iter()
            .filter(|rank| !rank.lines.synced)
            .filter_map(|rank| rank.completed_at)
            .map(|at| at + STDERR_GRACE)
            .min();
        panic.into_iter().chain(stderr).min()
    }

    fn past_deadline(&mut self) {
        if let Some((panicked, at)) = self.first_panic {
            if at.elapsed() >= PANIC_GRACE {
                let waiting: Vec<String> = (0..self.world.len())
                    .filter(|&rank| !self.world[rank].lines.done())
                    .map(|rank| rank.to_string())
                    .collect();
                eprintln!(
                    "[world] rank {panicked} panicked, and rank(s) {} had not finished {} s \
                     later (waiting for it in a collective?): the world's processes are \
                     stopped; the next %%distributed cell starts a new world",
                    waiting.join(", "),
                    PANIC_GRACE.as_secs()
                );
                self.stop(1);
            }
        }
        for rank in &mut self.world {
            // Its stderr's last line lacked a newline, or never came: the kernel waits as long.
            if rank
                .completed_at
                .is_some_and(|at| at.elapsed() >= STDERR_GRACE)
            {
                rank.lines.synced = true;
            }
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Instruction(line) => self.instruct(&line),
            Event::InstructionsEnded => self.stop(0),
            Event::Line { rank, stderr, line } => {
                let lines = &mut self.world[rank].lines;
                let routed = if stderr {
                    lines.stderr(line)
                } else {
                    lines.stdout(line)
                };
                if routed == Routed::AnswerEmpty {
                    let stdin = &mut self.world[rank].stdin;
                    let _ = writeln!(stdin).and_then(|()| stdin.flush());
                }
                write_routed(routed);
                let ranked = &mut self.world[rank];
                if ranked.lines.completed && ranked.completed_at.is_none() {
                    ranked.completed_at = Some(Instant::now());
                }
                if ranked.lines.panicked && self.first_panic.is_none() {
                    self.first_panic = Some((rank, Instant::now()));
                }
            }
            Event::Closed { rank } => {
                self.world[rank].open_streams -= 1;
                if self.world[rank].open_streams == 0 {
                    self.rank_ended(rank);
                }
            }
        }
    }

    /// An instruction from evcxr: to every rank between cells (a new cell starts with
    /// `LOAD_AND_RUN`); to rank 0 while a cell runs (an answer to its input request).
    fn instruct(&mut self, line: &str) {
        let targets = if self.cell_running {
            1
        } else {
            self.world.len()
        };
        if !self.cell_running && line.starts_with("LOAD_AND_RUN ") {
            self.cell_running = true;
            self.first_panic = None;
            for rank in &mut self.world {
                rank.lines.next_cell();
                rank.completed_at = None;
            }
        }
        for rank in self.world.iter_mut().take(targets) {
            // A rank that cannot be written to has ended: its streams' end says so.
            let _ = writeln!(rank.stdin, "{line}").and_then(|()| rank.stdin.flush());
        }
    }

    /// A rank's streams both ended: it is gone, and the world with it.
    fn rank_ended(&mut self, rank: usize) -> ! {
        let status = self.world[rank]
            .process
            .wait()
            .map_or_else(|error| error.to_string(), |status| status.to_string());
        let when = if self.cell_running {
            "during the cell"
        } else {
            "between cells"
        };
        eprintln!(
            "[world] rank {rank} ended {when} ({status}): the other ranks are stopped; the next \
             %%distributed cell starts a new world"
        );
        self.stop(1)
    }

    /// Stops every rank, removes the store and exits with `code`.
    fn stop(&mut self, code: i32) -> ! {
        for rank in &mut self.world {
            let _ = rank.process.kill();
        }
        for rank in &mut self.world {
            let _ = rank.process.wait();
        }
        let _ = std::fs::remove_file(&self.store);
        let _ = std::io::stderr().flush();
        super::exit_now(code)
    }
}

/// Tells evcxr the cell ended on every rank: rank 0's report, with every rank's memory record
/// beside its own and a panic anywhere the cell's panic.
fn end_cell(world: &mut [Rank]) {
    let any_panicked = world.iter().any(|rank| rank.lines.panicked);
    let zero_panicked = world[0].lines.panicked;
    let reports: Vec<Option<CellReport>> = world
        .iter_mut()
        .map(|rank| rank.lines.take_report())
        .collect();
    let sync = world[0].lines.take_sync();
    let mut out = std::io::stdout().lock();
    if any_panicked && !zero_panicked {
        let _ = writeln!(out, "{PANIC_NOTIFICATION}");
    }
    let rank_memory = reports
        .iter()
        .map(|report| report.as_ref().and_then(|report| report.memory.clone()))
        .collect();
    if let Some(Some(mut report)) = reports.into_iter().next() {
        report.panicked |= any_panicked;
        report.rank_memory = rank_memory;
        for line in report_block(&report) {
            let _ = writeln!(out, "{line}");
        }
    }
    let _ = out.flush();
    if let Some(sync) = sync {
        let mut err = std::io::stderr().lock();
        let _ = writeln!(err, "{sync}").and_then(|()| err.flush());
    }
    let _ = writeln!(out, "{EXECUTION_COMPLETE}").and_then(|()| out.flush());
}

fn write_routed(routed: Routed) {
    match routed {
        Routed::Stdout(line) => {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{line}").and_then(|()| out.flush());
        }
        Routed::Stderr(line) => {
            let mut err = std::io::stderr().lock();
            let _ = writeln!(err, "{line}").and_then(|()| err.flush());
        }
        Routed::Held | Routed::AnswerEmpty => {}
    }
}

/// A fresh path for the group's file store (c10d's FileStore wants it absent).
fn store_path() -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos());
    std::env::temp_dir().join(format!("tchmem-world-{}-{nanos}.store", std::process::id()))
}

/// Starts rank `rank`: this binary as a cell-running child, told its place in the group.
fn start_rank(
    rank: usize,
    ranks: usize,
    store: &std::path::Path,
    events: &Sender<Event>,
) -> std::io::Result<Rank> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe()?;
    let mut command = Command::new(exe);
    command
        .env_remove(RANKS_ENV)
        .env("TCHMEM_RANK", rank.to_string())
        .env("TCHMEM_WORLD_SIZE", ranks.to_string())
        .env("TCHMEM_DIST_STORE", store)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: prctl is async-signal-safe; a rank must not outlive its launcher (the kernel
    // stops a world's child with SIGKILL, which no handler of ours sees).
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut process = command.spawn()?;
    let stdin = process.stdin.take().expect("piped stdin");
    let stdout = process.stdout.take().expect("piped stdout");
    let stderr = process.stderr.take().expect("piped stderr");
    pump_lines(rank, false, stdout, events.clone());
    pump_lines(rank, true, stderr, events.clone());
    RANK_PIDS[rank].store(process.id() as i32, Ordering::SeqCst);
    Ok(Rank {
        process,
        stdin,
        lines: RankLines::new(rank),
        open_streams: 2,
        completed_at: None,
    })
}

/// Sends each line of a rank's stream as an event, then its end.
fn pump_lines(
    rank: usize,
    stderr: bool,
    stream: impl Read + Send + 'static,
    events: Sender<Event>,
) {
    let name = format!("rank-{rank}-{}", if stderr { "stderr" } else { "stdout" });
    let spawned = std::thread::Builder::new().name(name).spawn(move || {
        for line in BufReader::new(stream).split(b'\n') {
            let Ok(line) = line else { break };
            let line = String::from_utf8_lossy(&line).into_owned();
            if events.send(Event::Line { rank, stderr, line }).is_err() {
                return;
            }
        }
        let _ = events.send(Event::Closed { rank });
    });
    if let Err(error) = spawned {
        eprintln!("tchmem world: cannot read rank {rank}'s output: {error}");
    }
}

/// Sends evcxr's lines as events, on a thread of their own. When evcxr closes stdin the world
/// ends from here: the main thread may be blocked writing output nobody reads any more.
fn read_instructions(events: Sender<Event>, store: PathBuf) {
    let spawned = std::thread::Builder::new()
        .name("world-stdin".into())
        .spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if events.send(Event::Instruction(line)).is_err() {
                    return;
                }
            }
            let _ = events.send(Event::InstructionsEnded);
            std::thread::sleep(Duration::from_secs(1));
            pass_on(libc::SIGKILL);
            let _ = std::fs::remove_file(&store);
            super::exit_now(0);
        });
    if let Err(error) = spawned {
        eprintln!("tchmem world: cannot read instructions: {error}");
        super::exit_now(99);
    }
}

extern "C" fn pass_on(signal: libc::c_int) {
    // Async-signal-safe: atomic loads and kill(2).
    for pid in &RANK_PIDS {
        let pid = pid.load(Ordering::SeqCst);
        if pid > 0 {
            // SAFETY: kill(2) on a process id of ours.
            unsafe { libc::kill(pid, signal) };
        }
    }
}

/// The kernel's interrupt signals (see [`super::interrupt`]) go on to every rank.
fn forward_signals() {
    // The handler only reads atomics and calls kill(2).
    super::interrupt::on_interrupt_signals(pass_on);
}
