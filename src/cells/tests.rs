//! The cells layer over a fake runner: what a cell means, tested in milliseconds without a
//! compiler or libtorch. The fake answers trials like a GPU with a known allocator limit, so the
//! orchestration (trial outcomes, the batch search, OOM diagnosis, `--fit`'s choice) runs for
//! real on it.

use std::sync::Mutex;

use tchmem_wire::compare::{CompareRun, COMPARE_RUN_MIME};
use tchmem_wire::estimate::{DeviceRoom, DEVICE_ROOM_MIME};
use tchmem_wire::progress::LiveSample;

use super::*;

const MIB: u64 = 1 << 20;

/// A simulated training step on a GPU: the peak is `fixed + per_sample · batch` (a third of the
/// activations under checkpointing, half under bf16, a K-th under K micro-batches); a peak over
/// `limit` runs out of memory as libtorch reports it.
#[derive(Clone, Copy)]
struct Gpu {
    limit: u64,
    fixed: u64,
    per_sample: u64,
}

impl Gpu {
    fn peak(&self, code: &str) -> u64 {
        let batch = batch_of(code);
        let mut per_sample = self.per_sample;
        if code.contains("tchmem::checkpoint::") {
            per_sample /= 3;
        }
        if code.contains("tchmem::amp::autocast") {
            per_sample /= 2;
        }
        let micro = match accumulation_of(code) {
            Some(k) => batch.div_ceil(k),
            None => batch,
        };
        self.fixed + per_sample * micro
    }

    fn answer(&self, code: &str) -> CellOutcome {
        if code.contains("tchmem::estimate::room()") {
            let room = DeviceRoom {
                total: self.limit,
                free: self.limit,
                reserved: 0,
                allocated: 0,
                fraction: 1.0,
                context: Some(500 * MIB),
            };
            return data(
                DEVICE_ROOM_MIME,
                serde_json::to_string(&Some(room)).unwrap(),
            );
        }
        if !code.contains("tchmem::compare::begin") {
            return CellOutcome::default();
        }
        let peak = self.peak(code);
        if peak > self.limit {
            return fail(CellError::new(
                ErrorName::Panic,
                "Torch(\"CUDA out of memory. Tried to allocate 2.00 GiB\")",
            ));
        }
        let run = CompareRun {
            steps_wanted: 3,
            losses: vec![2.30, 2.20, 2.10],
            step_seconds: vec![0.5, 0.1, 0.1],
            allocated_at_begin: Some(0),
            peak_allocated: Some(peak),
            peak_reserved: Some(peak),
            allocated_after_step: Some(self.fixed),
            ..Default::default()
        };
        data(COMPARE_RUN_MIME, serde_json::to_string(&run).unwrap())
    }
}

/// The batch literal the trial put into the cell (`let batch_size: i64 = N;`, or a const of
/// an earlier cell brought in front of it).
fn batch_of(code: &str) -> u64 {
    let (_, rest) = code
        .split_once("let batch_size: i64 = ")
        .or_else(|| code.split_once("const BATCH_SIZE: i64 = "))
        .expect("the cell binds its batch");
    rest.split(';').next().unwrap().trim().parse().unwrap()
}

/// K of a `--accumulate K` rewrite, as the rewritten loop splits its batch.
fn accumulation_of(code: &str) -> Option<u64> {
    let (_, rest) = code.split_once("tchmem::accumulate::split(")?;
    let args = rest.split(')').next()?;
    args.rsplit(',').next()?.trim().parse().ok()
}

fn data(mime: &str, json: String) -> CellOutcome {
    CellOutcome {
        data: [(mime.to_string(), json)].into(),
        ..Default::default()
    }
}

/// A runner that answers from a script and keeps what it was asked to run.
struct FakeRunner {
    answer: Box<dyn FnMut(&str) -> CellOutcome>,
    ran: Vec<String>,
    generation: u64,
    variables: Vec<(String, String)>,
    /// The ranks of each world started from this runner.
    worlds: Vec<usize>,
    /// The `src/` folders of the dependencies it knows.
    sources: std::collections::HashMap<String, std::path::PathBuf>,
}

impl FakeRunner {
    fn new(answer: impl FnMut(&str) -> CellOutcome + 'static) -> FakeRunner {
        FakeRunner {
            answer: Box::new(answer),
            ran: Vec::new(),
            generation: 0,
            variables: Vec::new(),
            worlds: Vec::new(),
            sources: Default::default(),
        }
    }

    fn on(gpu: Gpu) -> FakeRunner {
        FakeRunner::new(move |code| gpu.answer(code))
    }

    /// The trials it ran (the cells that begin a compare run), in order.
    fn trials(&self) -> Vec<&String> {
        self.ran
            .iter()
            .filter(|code| code.contains("tchmem::compare::begin"))
            .collect()
    }
}

impl Runner for FakeRunner {
    fn run(&mut self, code: &str, io: CellIo) -> CellOutcome {
        self.ran.push(code.to_string());
        if code.contains("tchmem::compare::begin") {
            // A trial long enough for the live view: the child's sample of its first second.
            (io.output)(CellOutput::Live(LiveSample {
                elapsed: 1.0,
                ..Default::default()
            }));
        }
        (self.answer)(code)
    }

    fn has_runtime(&self) -> bool {
        true
    }

    fn dependency_source(&self, krate: &str) -> Option<std::path::PathBuf> {
        self.sources.get(krate).cloned()
    }

    fn process_generation(&self) -> u64 {
        self.generation
    }

    fn variables(&self) -> Vec<(String, String)> {
        self.variables.clone()
    }

    fn take_commands(&mut self, code: &str) -> (String, Vec<Result<String, String>>) {
        (code.to_string(), Vec::new())
    }

    fn set_line_tables(&mut self, _on: bool) {}

    fn generated_source(&self) -> Vec<String> {
        Vec::new()
    }

    fn start_world(&mut self, ranks: usize) -> Result<FakeRunner, String> {
        if ranks == 3 {
            return Err("three is a crowd".into());
        }
        self.worlds.push(ranks);
        Ok(FakeRunner::new(|_| CellOutcome::default()))
    }
}

/// What a cell showed: every display's plain text and every stream's text, in order.
#[derive(Clone, Default)]
struct Shown(Arc<Mutex<Vec<String>>>);

impl Shown {
    fn io(&self) -> CellIo {
        let shown = Arc::clone(&self.0);
        CellIo {
            output: Arc::new(move |output| {
                let text = match output {
                    CellOutput::Stream(_, text) => text,
                    CellOutput::Display(display) => {
                        let text = display.data.get("text/plain").and_then(|t| t.as_str());
                        text.unwrap_or_default().to_string()
                    }
                    CellOutput::ClearOutput { .. } | CellOutput::Live(_) => return,
                };
                shown.lock().unwrap().push(text);
            }),
            input: None,
        }
    }

    fn last(&self) -> String {
        self.0.lock().unwrap().last().cloned().unwrap_or_default()
    }

    fn all(&self) -> String {
        self.0.lock().unwrap().join("\n")
    }
}

const LOOP: &str = "\
use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
let batch_size: i64 = 64;
let vs = nn::VarStore::new(Device::Cuda(0));
let model = nn::seq()
    .add(nn::linear(vs.root() / \"a\", 64, 256, Default::default()))
    .add_fn(|x| x.relu())
    .add(nn::linear(vs.root() / \"b\", 256, 10, Default::default()));
let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
let xs = Tensor::randn([batch_size, 64], (Kind::Float, Device::Cuda(0)));
let ys = Tensor::randint(10, [batch_size], (Kind::Int64, Device::Cuda(0)));
for _ in 0..3 {
    let loss = model.forward(&xs).cross_entropy_for_logits(&ys);
    opt.backward_step(&loss);
}
";

fn cells(runner: FakeRunner) -> Cells<FakeRunner> {
    let dir = std::env::temp_dir().join(format!("tchmem-cells-test-{}", std::process::id()));
    Cells::new(runner, dir)
}

fn gpu() -> Gpu {
    Gpu {
        limit: 8 * 1024 * MIB,
        fixed: 1024 * MIB,
        per_sample: 64 * MIB,
    }
}

#[test]
fn let_bindings_are_recognised() {
    assert!(binds("let vs = nn::VarStore::new(d);", "vs"));
    assert!(binds("let mut vs: nn::VarStore = x;", "vs"));
    assert!(!binds("let vs2 = 1; watch(&vs);", "vs"));
    assert!(!binds("tchmem::watch(&vs);", "vs"));
}

/// The training cell `%memfit` reads from [`LOOP`], for calling trials directly.
fn memfit_cell(cells: &mut Cells<FakeRunner>) -> super::trial::TrainingCell {
    cells
        .training_cell(
            &magics::CellMagicSource {
                line: "%memfit",
                body: LOOP,
                body_offset: 1,
            },
            "%memfit",
        )
        .unwrap()
}

#[test]
fn a_trial_tells_a_run_an_oom_a_failure_and_a_stop_apart() {
    let answers = Arc::new(Mutex::new(Vec::<CellOutcome>::new()));
    let queue = Arc::clone(&answers);
    let mut cells = cells(FakeRunner::new(move |code| {
        if code.contains("tchmem::compare::begin") {
            queue.lock().unwrap().remove(0)
        } else {
            gpu().answer(code)
        }
    }));
    let cell = memfit_cell(&mut cells);
    let options = rewrite::Options::default();
    answers.lock().unwrap().extend([
        gpu().answer("let batch_size: i64 = 8;\ntchmem::compare::begin(3);"),
        fail(CellError::new(ErrorName::Panic, "CUDA out of memory")),
        fail(CellError::new(ErrorName::Panic, "index out of bounds")),
        fail(CellError::new(ErrorName::Interrupted, "stopped")),
    ]);
    let ran = cells.trial(&cell, &options, 8, 3).ok().unwrap();
    assert!(matches!(ran.outcome, crate::fit::trial::Outcome::Ran(_)));
    let oom = cells.trial(&cell, &options, 8, 3).ok().unwrap();
    assert_eq!(oom.outcome, crate::fit::trial::Outcome::OutOfMemory);
    let failed = cells.trial(&cell, &options, 8, 3).ok().unwrap();
    assert_eq!(
        failed.outcome,
        crate::fit::trial::Outcome::Failed("Panic: index out of bounds".into())
    );
    let stopped = cells.trial(&cell, &options, 8, 3);
    assert!(matches!(stopped, Err(super::trial::TrialError::Stopped(_))));
    // Each trial ran the cell at the batch it was asked for.
    let trials: Vec<u64> = cells
        .runner
        .trials()
        .into_iter()
        .map(|code| batch_of(code))
        .collect();
    assert_eq!(trials, [8, 8, 8, 8]);
}

#[test]
fn under_cudnns_benchmark_mode_a_trial_runs_again_on_the_chosen_algorithms() {
    // The first run at a shape times cuDNN's algorithms (a large peak); cuDNN keeps its choice,
    // so the second run at that shape does not.
    let runs = Arc::new(Mutex::new(0));
    let counted = Arc::clone(&runs);
    let mut benchmarked = cells(FakeRunner::new(move |code| {
        let outcome = gpu().answer(code);
        if !code.contains("tchmem::compare::begin") {
            return outcome;
        }
        let mut n = counted.lock().unwrap();
        *n += 1;
        let searching = *n == 1;
        with_run(outcome, |run| {
            run.cudnn_benchmark = true;
            if searching {
                run.peak_reserved = Some(3 << 30);
            }
        })
    }));
    let cell = memfit_cell(&mut benchmarked);
    let trial = benchmarked
        .trial(&cell, &rewrite::Options::default(), 8, 3)
        .ok()
        .unwrap();
    assert_eq!(*runs.lock().unwrap(), 2, "the trial ran twice");
    let measured = trial.outcome.measured().unwrap();
    let steady = gpu().peak("let batch_size: i64 = 8;");
    assert_eq!(measured.peak_reserved, steady, "the second run's peak");
    let search = measured.algorithm_search.unwrap();
    assert_eq!(search.peak_reserved, 3 << 30, "the first run's, kept apart");
    // Without the mode a trial runs once (the other tests' fake never sets it).
    let mut plain = cells(FakeRunner::on(gpu()));
    let cell = memfit_cell(&mut plain);
    let trial = plain
        .trial(&cell, &rewrite::Options::default(), 8, 3)
        .ok()
        .unwrap();
    assert_eq!(plain.runner.trials().len(), 1);
    assert_eq!(trial.outcome.measured().unwrap().algorithm_search, None);
}

#[test]
fn under_cudnns_benchmark_mode_a_trial_without_convolutions_runs_once() {
    // The mode times convolutions only: a run that recorded operators and none of them a
    // convolution (a transformer) has nothing to run again for; one that did, has.
    for (op, runs) in [("aten::linear", 1), ("aten::conv2d", 2)] {
        let mut benchmarked = cells(FakeRunner::new(move |code| {
            with_run(gpu().answer(code), |run| {
                run.cudnn_benchmark = true;
                run.ops = Some(tchmem_wire::op_trace::OpTrace {
                    id: 1,
                    ops: vec![tchmem_wire::op_trace::OpCost {
                        name: op.into(),
                        start: 0,
                        excess: 0,
                    }],
                });
            })
        }));
        let cell = memfit_cell(&mut benchmarked);
        let trial = benchmarked
            .trial(&cell, &rewrite::Options::default(), 8, 3)
            .ok()
            .unwrap();
        assert_eq!(benchmarked.runner.trials().len(), runs, "with {op}");
        let search = trial.outcome.measured().unwrap().algorithm_search;
        assert_eq!(search.is_some(), runs == 2, "with {op}");
    }
}

#[test]
fn under_cudnns_benchmark_mode_compare_runs_each_side_again_and_says_why() {
    // Each side's first run times cuDNN's algorithms (9 GiB reserved); the second does not.
    let mut runs = 0;
    let mut benchmarked = cells(FakeRunner::new(move |code| {
        let outcome = gpu().answer(code);
        if !code.contains("tchmem::compare::begin") {
            return outcome;
        }
        runs += 1;
        let searching = runs % 2 == 1;
        with_run(outcome, |run| {
            run.cudnn_benchmark = true;
            if searching {
                run.peak_reserved = Some(9 << 30);
            }
        })
    }));
    let shown = Shown::default();
    let outcome = benchmarked.execute(
        &format!("%%optimize --amp bf16 --compare 3\n{LOOP}"),
        shown.io(),
    );
    assert_eq!(outcome.error, None);
    assert_eq!(benchmarked.runner.trials().len(), 4, "each side ran twice");
    let text = shown.all();
    assert!(
        text.contains("original, again on cuDNN's chosen algorithms")
            && text.contains("rewritten, again on cuDNN's chosen algorithms"),
        "{text}"
    );
    assert!(
        text.contains("cuDNN's benchmark mode was on: each side ran twice")
            && text.contains(
                "the first run reserved more (by the loop): original 9.0 GiB, rewritten 9.0 GiB."
            ),
        "{text}"
    );
    // The table's peak reserved is the second run's, not the search's.
    let row = text
        .lines()
        .find(|line| line.starts_with("peak reserved by the loop"))
        .expect("the table has the row");
    assert!(
        !row.contains("9.0 GiB") && row.contains("5.0 GiB") && row.contains("3.0 GiB"),
        "{row}"
    );
}

/// The exploratory pattern: the batch and the model in earlier cells, the loop alone.
const SPLIT_CELLS: [&str; 2] = [
    "const BATCH_SIZE: i64 = 64;",
    "use tch::{nn, nn::Module, nn::OptimizerConfig, Device, Kind, Tensor};
let vs = nn::VarStore::new(Device::Cuda(0));
let model = nn::linear(vs.root() / \"a\", 64, 10, Default::default());
let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();",
];
const SPLIT_LOOP: &str = "\
for _ in 0..3 {
    let xs = Tensor::randn([BATCH_SIZE, 64], (Kind::Float, Device::Cuda(0)));
    let ys = Tensor::randint(10, [BATCH_SIZE], (Kind::Int64, Device::Cuda(0)));
    let loss = model.forward(&xs).cross_entropy_for_logits(&ys);
    opt.backward_step(&loss);
}";

#[test]
fn memfit_follows_the_batch_optimizer_and_model_back_to_their_cells() {
    let mut cells = cells(FakeRunner::on(gpu()));
    let shown = Shown::default();
    for cell in SPLIT_CELLS {
        assert_eq!(cells.execute(cell, shown.io()).error, None);
    }
    let outcome = cells.execute(&format!("%memfit\n{SPLIT_LOOP}"), shown.io());
    assert_eq!(outcome.error, None);
    let text = shown.last();
    assert!(
        text.contains("Use it:  const BATCH_SIZE: i64 = 99; (in cell [1])"),
        "{text}"
    );
    let trials = cells.runner.trials();
    assert!(!trials.is_empty());
    for trial in trials {
        // A fresh optimizer from cell [2] and the model's store kept and put back.
        assert!(
            trial.contains("// from cell [2]\nlet mut opt = nn::Adam::default()"),
            "{trial}"
        );
        assert!(trial.contains("tchmem::keep::keep_all(&[&vs])"), "{trial}");
    }
    // Nothing of the session changed: the loop's own cell binds nothing new.
    let shown = Shown::default();
    let outcome = cells.execute(
        &format!("%%optimize --show --optimizer lion\n{SPLIT_LOOP}"),
        shown.io(),
    );
    assert_eq!(outcome.error, None);
    let text = shown.last();
    assert!(
        text.contains("the optimizer `opt` is built in cell [2]"),
        "{text}"
    );
    assert!(text.contains("tchmem::optim::Lion"), "{text}");
}

#[test]
fn a_model_a_librarys_function_builds_is_checkpointed_from_the_librarys_source() {
    // A library `tch` whose `vision::tiny` module builds its model with nn::seq_t(), as
    // tch::vision's models do.
    let library = std::env::temp_dir().join(format!("tchmem-library-{}", std::process::id()));
    let module = library.join("tch-0.24.0/src/vision");
    std::fs::create_dir_all(&module).unwrap();
    std::fs::write(
        module.join("tiny.rs"),
        "//! A tiny model.\nuse crate::nn;\n\
         fn block(p: nn::Path, c: i64) -> impl nn::ModuleT {\n    \
         nn::seq_t().add(nn::linear(&p / \"l\", c, c, Default::default())).add_fn(|x| x.relu())\n}\n\
         pub fn tiny(p: &nn::Path, c: i64) -> nn::SequentialT {\n    \
         nn::seq_t().add(block(p / \"b0\", c)).add(block(p / \"b1\", c))\n}\n",
    )
    .unwrap();
    let mut runner = FakeRunner::on(gpu());
    runner
        .sources
        .insert("tch".into(), library.join("tch-0.24.0/src"));
    let mut cells = cells(runner);
    let shown = Shown::default();
    let earlier = [
        "const BATCH_SIZE: i64 = 64;",
        "use tch::{nn, nn::ModuleT, nn::OptimizerConfig, Device, Kind, Tensor};\n\
         use tch::vision::tiny;\n\
         let vs = nn::VarStore::new(Device::Cuda(0));\n\
         let net = tiny::tiny(&vs.root(), 64);\n\
         let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();",
    ];
    for cell in earlier {
        assert_eq!(cells.execute(cell, shown.io()).error, None);
    }
    let training = SPLIT_LOOP.replace("model.forward(&xs)", "net.forward_t(&xs, true)");
    let outcome = cells.execute(
        &format!("%%optimize --checkpoint --show\n{training}"),
        shown.io(),
    );
    assert_eq!(outcome.error, None, "{}", shown.all());
    let text = shown.all();
    assert!(
        text.contains(
            "the model `net` is built in cell [2] by `tch::vision::tiny::tiny` \
             (tch-0.24.0/src/vision/tiny.rs)"
        ),
        "{text}"
    );
    assert!(text.contains("mod __tchmem_tiny {"), "{text}");
    assert!(
        text.contains("__tchmem_tiny::tiny(&vs.root(), 64)"),
        "{text}"
    );
    // Both builders of the module, and the change line's (the only nn::seq_t() left).
    assert_eq!(
        text.matches("tchmem::checkpoint::seq_t()").count(),
        3,
        "{text}"
    );
    assert_eq!(text.matches("nn::seq_t()").count(), 1, "{text}");
    assert!(text.contains("use tch::nn;"), "{text}");
    // One line for the builders brought in, however many they are.
    assert_eq!(
        text.matches("`net` (from cell [2]): --checkpoint").count(),
        1,
        "{text}"
    );
    // Without the library's sources, the refusal says how to get the same by hand.
    let mut cells = self::cells(FakeRunner::on(gpu()));
    for cell in earlier {
        assert_eq!(cells.execute(cell, shown.io()).error, None);
    }
    let outcome = cells.execute(
        &format!("%%optimize --checkpoint --show\n{training}"),
        shown.io(),
    );
    let error = outcome.error.expect("refused");
    assert!(
        error
            .evalue
            .contains("a function the notebook did not define"),
        "{}",
        error.evalue
    );
    std::fs::remove_dir_all(&library).unwrap();
}

#[test]
fn what_a_magic_runs_as_the_cell_is_followed_back_to_by_later_magics() {
    let mut cells = cells(FakeRunner::on(gpu()));
    let shown = Shown::default();
    for cell in SPLIT_CELLS {
        assert_eq!(cells.execute(cell, shown.io()).error, None);
    }
    // A real run of a swap: the rewritten loop, with the optimizer rebuilt as Lion, is the cell.
    let swap = format!("%%optimize --optimizer lion\n{SPLIT_LOOP}");
    assert_eq!(cells.execute(&swap, shown.io()).error, None);
    let shown = Shown::default();
    let outcome = cells.execute(
        &format!("%%optimize --show --optimizer adafactor\n{SPLIT_LOOP}"),
        shown.io(),
    );
    assert_eq!(outcome.error, None);
    let text = shown.last();
    let swapped = SPLIT_CELLS.len() + 1;
    assert!(
        text.contains(&format!("the optimizer `opt` is built in cell [{swapped}]")),
        "{text}"
    );
    // The optimizer the notebook now has: the Lion the real run built.
    assert!(
        text.contains(&format!(
            "// from cell [{swapped}]\nlet mut opt = tchmem::optim::Lion"
        )),
        "{text}"
    );
}

#[test]
fn memfit_finds_the_largest_batch_the_simulated_allocator_takes() {
    let gpu = gpu();
    let mut cells = cells(FakeRunner::on(gpu));
    let shown = Shown::default();
    let outcome = cells.execute(&format!("%memfit --margin 10%\n{LOOP}"), shown.io());
    assert_eq!(outcome.error, None);
    // 10% margin: ≤ 0.9 · 8 GiB reserved, so (7372.8 MiB − 1024 MiB) / 64 MiB = 99.2 → 99.
    let allowed = (gpu.limit as f64 * 0.9) as u64;
    let best = (allowed - gpu.fixed) / gpu.per_sample;
    assert_eq!(best, 99);
    let text = shown.last();
    assert!(
        text.contains(&format!("Largest batch that fits: {best} ")),
        "{text}"
    );
    assert!(
        text.contains(&format!("let batch_size = {best};")),
        "{text}"
    );
    let trials = cells.runner.trials().len();
    assert!(trials <= 8, "{trials} trials");
    // Each trial's live view showed under the magic's cell, saying which trial it was; the
    // trials' own output did not.
    let all = shown.all();
    assert_eq!(
        all.matches("running 1.0 s · trial at batch ").count(),
        trials,
        "{all}"
    );
    assert_eq!(
        all.matches("ran 1.0 s · trial at batch ").count(),
        trials,
        "{all}"
    );
}

#[test]
fn memfit_without_a_device_runs_nothing_and_says_why() {
    let mut cells = cells(FakeRunner::new(|code| {
        if code.contains("tchmem::estimate::room()") {
            data(DEVICE_ROOM_MIME, "null".into())
        } else {
            CellOutcome::default()
        }
    }));
    let shown = Shown::default();
    let outcome = cells.execute(&format!("%memfit\n{LOOP}"), shown.io());
    assert_eq!(outcome.error, None);
    assert!(
        shown.all().contains("no CUDA device here"),
        "{}",
        shown.all()
    );
    assert!(!cells
        .runner
        .ran
        .iter()
        .any(|c| c.contains("compare::begin")));
}

#[test]
fn an_oom_in_a_training_cell_is_diagnosed_with_measured_fixes() {
    let gpu = gpu();
    let mut cells = cells(FakeRunner::new(move |code| {
        if code.contains("tchmem::compare::begin") || code.contains("room()") {
            gpu.answer(code)
        } else if code.contains("backward_step") {
            // The cell itself, at its batch of 256: over the limit.
            fail(CellError::new(ErrorName::Panic, "CUDA out of memory"))
        } else {
            CellOutcome::default()
        }
    }));
    let shown = Shown::default();
    let outcome = cells.execute(&LOOP.replace("= 64;", "= 256;"), shown.io());
    let error = outcome.error.expect("the cell failed");
    assert_eq!(error.ename, ErrorName::OutOfMemory);
    // Two calibration trials below the failing batch, then fixes ranked from them.
    assert!(
        error.evalue.contains("Measured (trials at batch_size ="),
        "{}",
        error.evalue
    );
    assert!(error.evalue.contains("\n  1. "), "{}", error.evalue);
    assert!(error.evalue.contains("batch_size"), "{}", error.evalue);
}

#[test]
fn optimize_fit_runs_the_fastest_configuration_that_fits_the_budget() {
    // As written the loop needs 1 GiB + 64 MiB · 64 = 5 GiB: over a 3 GiB budget, which
    // checkpointing (1 GiB + 21 MiB · 64) or bf16 meet.
    let mut cells = cells(FakeRunner::on(gpu()));
    let shown = Shown::default();
    let outcome = cells.execute(&format!("%%optimize --fit 3GiB\n{LOOP}"), shown.io());
    assert_eq!(outcome.error, None, "{}", shown.all());
    let text = shown.all();
    assert!(text.contains("%%optimize --fit"), "{text}");
    // The loop that ran last (after the trials) is a rewrite, not the loop as written.
    let last = cells.runner.ran.last().unwrap();
    assert!(
        [
            "tchmem::checkpoint::",
            "tchmem::amp::",
            "tchmem::accumulate::"
        ]
        .iter()
        .any(|rewrite| last.contains(rewrite)),
        "{last}"
    );
    assert_eq!(batch_of(last), 64, "the cell's own batch runs");
}

/// `outcome` with its compare run (a trial's measurements, where it has one) changed by `edit`.
fn with_run(mut outcome: CellOutcome, edit: impl FnOnce(&mut CompareRun)) -> CellOutcome {
    if let Some(json) = outcome.data.get_mut(COMPARE_RUN_MIME) {
        let mut run: CompareRun = serde_json::from_str(json).unwrap();
        edit(&mut run);
        *json = serde_json::to_string(&run).unwrap();
    }
    outcome
}

/// A GPU whose trials time their optimizer step (5 ms for the cell's Adam) where `timed` (but
/// never Adafactor's), and where Lion steps, 40 ms shorter steps.
fn gpu_with_a_fast_lion(timed: bool) -> impl FnMut(&str) -> CellOutcome {
    move |code: &str| {
        with_run(gpu().answer(code), |run| {
            let lion = code.contains("Lion");
            if lion {
                run.step_seconds = vec![0.5, 0.06, 0.06];
            }
            if timed && !code.contains("Adafactor") {
                run.optimizer_step_seconds = vec![if lion { 0.001 } else { 0.005 }];
            }
        })
    }
}

#[test]
fn optimize_fit_times_each_swapped_optimizer_before_it_ranks_them() {
    // Everything fits in 20 GiB; only Lion's step is faster, which the calibration trials (all
    // Adam) cannot show. Timed at the smaller calibration batch, it ranks first and wins.
    let mut cells = cells(FakeRunner::new(gpu_with_a_fast_lion(true)));
    let shown = Shown::default();
    let outcome = cells.execute(&format!("%%optimize --fit 20GiB\n{LOOP}"), shown.io());
    assert_eq!(outcome.error, None, "{}", shown.all());
    let text = shown.all();
    assert!(
        text.contains("optimizer step 1.0 ms (the cell's 5.0 ms)"),
        "{text}"
    );
    // A swap whose trial timed no optimizer step keeps the cell's time, and says so.
    assert!(
        text.contains("optimizer step not timed: ranked at the cell's"),
        "{text}"
    );
    let trials = cells.runner.trials();
    let swapped = trials
        .iter()
        .filter(|code| {
            ["Lion", "Adafactor", "AdamW8bit"]
                .iter()
                .any(|name| code.contains(&format!("tchmem::optim::{name}")))
        })
        .collect::<Vec<_>>();
    assert!(swapped.len() >= 3, "{swapped:?}");
    assert_eq!(
        batch_of(swapped[0]),
        16,
        "timed at the smaller calibration batch"
    );
    let last = cells.runner.ran.last().unwrap();
    assert!(last.contains("tchmem::optim::Lion"), "{last}");
    assert_eq!(batch_of(last), 64);

    // Without the optimizer's time, the swaps tie with the cell's optimizer: the loop as written
    // wins (fewest rewrites), and the table says why the swaps were not timed.
    let mut cells = self::cells(FakeRunner::new(gpu_with_a_fast_lion(false)));
    let shown = Shown::default();
    let outcome = cells.execute(&format!("%%optimize --fit 20GiB\n{LOOP}"), shown.io());
    assert_eq!(outcome.error, None, "{}", shown.all());
    assert!(shown.all().contains("The loop fits as written."));
    assert!(shown.all().contains("did not time the optimizer's step"));
}

#[test]
fn optimize_fit_replays_the_heaviest_operators_of_each_base_at_the_cells_batch() {
    // On the trials' line the loop needs 6 GiB at 64 (80 MiB a sample over 1 GiB); run alone
    // there, its backward takes a 512 MiB workspace, not 3 GiB: 3.5 GiB, which a trial at 64
    // confirms. In 4 GiB, the loop as written fits.
    let mut recording = recording_gpu(Some(512 * MIB));
    let mut cells = cells(FakeRunner::new(move |code: &str| {
        with_run(recording(code), |run| {
            if batch_of(code) == 64 {
                let peak = (1024 + 32 * 64 + 512) * MIB;
                run.peak_allocated = Some(peak);
                run.peak_reserved = Some(peak);
            }
        })
    }));
    let shown = Shown::default();
    let outcome = cells.execute(&format!("%%optimize --fit 4GiB\n{LOOP}"), shown.io());
    assert_eq!(outcome.error, None, "{}", shown.all());
    // Each base's replay right after its two calibration trials (the child keeps only the last
    // few recordings): trials and replays alternate two to one until the swaps are timed.
    let ran = &cells.runner.ran;
    let is_replay = |code: &String| code.starts_with("tchmem::op_trace::replay(");
    let steps: Vec<char> = ran
        .iter()
        .filter(|code| is_replay(code) || code.contains("tchmem::compare::begin_recording_ops"))
        .map(|code| if is_replay(code) { 'r' } else { 't' })
        .collect();
    let steps: String = steps.into_iter().collect();
    let bases = steps.matches('r').count();
    assert!(bases >= 2, "{steps}");
    assert!(steps.starts_with(&"ttr".repeat(bases)), "{steps}");
    assert!(
        ran.iter()
            .filter(|code| is_replay(code))
            .all(|code| code.contains(", 64, ")),
        "{ran:?}"
    );
    assert!(
        shown.all().contains("The loop fits as written."),
        "{}",
        shown.all()
    );
    let last = cells.runner.ran.last().unwrap();
    assert!(!last.contains("tchmem::accumulate::"), "{last}");
    assert_eq!(batch_of(last), 64);
}

#[test]
fn a_magic_mistake_is_explained_and_runs_nothing() {
    let mut cells = cells(FakeRunner::on(gpu()));
    let outcome = cells.execute(&format!("%memfit --margin lots\n{LOOP}"), CellIo::quiet());
    let error = outcome.error.expect("refused");
    assert_eq!(error.ename, ErrorName::MagicError);
    assert!(cells.runner.ran.is_empty());
    let outcome = cells.execute("%memestimate", CellIo::quiet());
    assert_eq!(outcome.error.unwrap().ename, ErrorName::NoTrainingCell);
}

#[test]
fn var_stores_are_watched_once_per_process() {
    let mut runner = FakeRunner::new(|_| CellOutcome::default());
    runner.variables = vec![("vs".into(), "tch::nn::VarStore".into())];
    let mut cells = cells(runner);
    cells.execute("let x = 1;", CellIo::quiet());
    cells.execute("let y = 2;", CellIo::quiet());
    let watches = |cells: &Cells<FakeRunner>| {
        cells
            .runner
            .ran
            .iter()
            .filter(|code| code.contains("tchmem::watch(&vs)"))
            .count()
    };
    assert_eq!(watches(&cells), 1);
    // A new process holds the store anew: it is watched again.
    cells.runner.generation += 1;
    cells.execute("let z = 3;", CellIo::quiet());
    assert_eq!(watches(&cells), 2);
}

/// A GPU whose trials record their operators: a layer whose excess grows with the batch, then a
/// backward whose workspace does on the trials (48 MiB a sample) but not at 64, where the
/// algorithm cuDNN picks needs 512 MiB. The replay cell answers from `replay`.
fn recording_gpu(replay: Option<u64>) -> impl FnMut(&str) -> CellOutcome {
    recording_gpu_with(replay, false)
}

/// [`recording_gpu`], with the batch built from one `narrow` per 16 samples before the step when
/// `per_sample` (one at 16, two at 32: the operators' lists differ).
fn recording_gpu_with(replay: Option<u64>, per_sample: bool) -> impl FnMut(&str) -> CellOutcome {
    use tchmem_wire::op_trace::{OpCost, OpReplay, OpTrace, OP_REPLAY_MIME};
    move |code| {
        if code.contains("tchmem::op_trace::replay(") {
            let answer = match replay {
                Some(workspace) => OpReplay {
                    excess: vec![Some(32 * 64 * MIB), Some(workspace)],
                    ..OpReplay::default()
                },
                None => OpReplay {
                    excess: vec![None, None],
                    allocations: Vec::new(),
                    error: Some("no operator recordings 16, 32".into()),
                },
            };
            return data(OP_REPLAY_MIME, serde_json::to_string(&answer).unwrap());
        }
        if !code.contains("tchmem::compare::begin_recording_ops") {
            return gpu().answer(code);
        }
        let b = batch_of(code);
        let op = |name: &str, start: u64, excess: u64| OpCost {
            name: name.into(),
            start,
            excess,
        };
        let run = CompareRun {
            steps_wanted: 3,
            losses: vec![2.3, 2.2, 2.1],
            step_seconds: vec![0.5, 0.1, 0.1],
            allocated_at_begin: Some(0),
            peak_allocated: Some((1024 + 80 * b) * MIB),
            peak_reserved: Some((1024 + 80 * b) * MIB),
            allocated_after_step: Some(1024 * MIB),
            ops: Some(OpTrace {
                id: b,
                ops: (0..if per_sample { b / 16 } else { 0 })
                    .map(|_| op("aten::narrow", 1024 * MIB, 0))
                    .chain([
                        op("aten::linear", 1024 * MIB, 32 * b * MIB),
                        op(
                            "aten::convolution_backward",
                            (1024 + 32 * b) * MIB,
                            48 * b * MIB,
                        ),
                    ])
                    .collect(),
            }),
            ..Default::default()
        };
        data(COMPARE_RUN_MIME, serde_json::to_string(&run).unwrap())
    }
}

/// Runs `%memestimate` on [`recording_gpu_with`] (the replay measuring a 512 MiB workspace) and
/// asserts the replay cell it ran (`replay`) and the activations it predicts from the replay.
fn assert_estimate_replays(per_sample: bool, replay: &str) {
    let mut cells = cells(FakeRunner::new(recording_gpu_with(
        Some(512 * MIB),
        per_sample,
    )));
    let shown = Shown::default();
    let outcome = cells.execute(&format!("%memestimate\n{LOOP}"), shown.io());
    assert_eq!(outcome.error, None, "{}", shown.all());
    assert!(
        cells.runner.ran.iter().any(|code| code == replay),
        "{:?}",
        cells.runner.ran
    );
    // 1 GiB + 32 MiB · 64 + the 512 MiB measured, not the trials' line (1 GiB + 80 MiB · 64).
    let row = activations_row(&shown.all());
    assert!(
        row.contains("the 2 heaviest run alone at this batch"),
        "{row}"
    );
    assert!(row.contains(" 3.5 GiB "), "{row}");
}

#[test]
fn an_estimate_replays_its_heaviest_operators_at_the_batch_it_predicts() {
    // Trials at 16 and 32 (recordings 16 and 32), then both operators run alone at 64.
    assert_estimate_replays(
        false,
        "tchmem::op_trace::replay(16, 32, (16, 32), 64, &[(0, 0), (1, 1)])",
    );
}

#[test]
fn an_estimate_replays_operators_by_their_index_in_each_trial_where_one_ran_more() {
    // The trial at 32 ran one narrow more: the linear and the convolution's backward are the
    // 2nd and 3rd operators at 16, the 3rd and 4th at 32, and the replay's answers go by the
    // latter, so the estimate is the one of equal lists.
    assert_estimate_replays(
        true,
        "tchmem::op_trace::replay(16, 32, (16, 32), 64, &[(1, 2), (2, 3)])",
    );
}

/// The activations' row of an estimate's table.
fn activations_row(text: &str) -> String {
    let row = text.lines().find(|line| line.starts_with("activations "));
    row.expect("an activations row").to_string()
}

#[test]
fn an_estimate_whose_replay_fails_keeps_the_trials_line() {
    let mut cells = cells(FakeRunner::new(recording_gpu(None)));
    let shown = Shown::default();
    let outcome = cells.execute(&format!("%memestimate\n{LOOP}"), shown.io());
    assert_eq!(outcome.error, None, "{}", shown.all());
    let text = shown.all();
    let row = activations_row(&text);
    assert!(
        row.contains("a line through the calibration trials"),
        "{row}"
    );
    assert!(row.contains(" 6.0 GiB "), "{row}");
}

#[test]
fn an_estimate_with_another_optimizer_runs_and_times_it_in_its_trials() {
    // Adafactor's steps take three times the cell's Adam's here: the estimate must say so, which
    // it cannot from trials of Adam. The model holds one 8192 × 8192 f32 matrix (256 MiB): Adam
    // keeps 512 MiB of state for it, Adafactor 64 KiB.
    let slow_adafactor = |code: &str| {
        with_run(gpu().answer(code), |run| {
            run.parameters = vec![tchmem_wire::estimate::ParamShape {
                dims: vec![8192, 8192],
                element_size: 4,
            }];
            if code.contains("Adafactor") {
                run.step_seconds = vec![1.5, 0.3, 0.3];
            }
        })
    };
    let mut cells = cells(FakeRunner::new(slow_adafactor));
    let shown = Shown::default();
    let outcome = cells.execute(
        &format!("%memestimate --optimizer adafactor\n{LOOP}"),
        shown.io(),
    );
    assert_eq!(outcome.error, None, "{}", shown.all());
    let trials = cells.runner.trials();
    assert_eq!(trials.len(), 2, "{trials:?}");
    assert!(
        trials.iter().all(|code| code.contains("Adafactor")),
        "{trials:?}"
    );
    let text = shown.all();
    let step = text
        .lines()
        .find(|l| l.contains("step time"))
        .unwrap_or_default();
    assert!(step.contains("300.0"), "{text}");
    // The trials' peaks hold Adafactor's state already: none is taken off as for a swap from
    // Adam (which would predict 512 MiB less: 5.0 GiB with the context).
    assert!(text.contains("Adafactor's rule"), "{text}");
    assert!(text.contains("fits: 5.5 GiB of"), "{text}");
}

#[test]
fn distributed_cells_run_in_one_world_kept_until_its_ranks_change() {
    let mut cells = Cells::new(
        FakeRunner::new(|_| CellOutcome::default()),
        std::env::temp_dir(),
    );
    let shown = Shown::default();
    let first = cells.execute("%%distributed --procs 2\nlet r = 1;\n", shown.io());
    assert!(first.error.is_none(), "{:?}", first.error);
    assert!(shown.all().contains("2 ranks started"), "{}", shown.all());
    cells.execute("%%distributed --procs 2\nprintln!(\"{r}\");", shown.io());
    assert_eq!(cells.runner.worlds, vec![2]);
    let world = cells.world.as_ref().unwrap();
    // The body alone, on the magic's line a blank one: compile errors name the cell's lines.
    assert_eq!(
        world.runner.ran,
        vec!["\nlet r = 1;\n", "\nprintln!(\"{r}\");"]
    );
    assert!(
        cells.runner.ran.is_empty(),
        "the notebook's own process ran nothing"
    );
    cells.execute("%%distributed --procs 4\n1", shown.io());
    assert_eq!(cells.runner.worlds, vec![2, 4]);
    assert!(shown.all().contains("world of 2 ranks is stopped"));
    assert_eq!(cells.world.as_ref().unwrap().runner.ran, vec!["\n1"]);
    let failed = cells.execute("%%distributed --procs 3\n1", shown.io());
    let error = failed.error.unwrap();
    assert_eq!(error.ename, ErrorName::WorldFailed);
    assert!(
        error.evalue.contains("three is a crowd"),
        "{}",
        error.evalue
    );
    let flag = cells
        .execute("%%distributed --procs\n1", shown.io())
        .error
        .unwrap();
    assert_eq!(flag.ename, ErrorName::MagicError);
    let empty = cells
        .execute("%%distributed --procs 2\n", shown.io())
        .error
        .unwrap();
    assert!(empty.evalue.contains("nothing after"), "{}", empty.evalue);
}
