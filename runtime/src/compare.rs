//! Measuring a training loop for `%%optimize --compare` (and the trial runs of a memory
//! estimate): the kernel runs the loop instrumented to call [`record_step`] after every
//! optimizer step and to stop after a number of steps, between [`begin`] and [`finish`] in one
//! cell.
//!
//! On CUDA, the loop's phase markers (`tchmem::phase`) also split the run's peak by phase: each
//! marker hands the allocator's peak since the previous one to the phase that just ended and
//! restarts the peaks; the run's overall peaks are kept across those restarts.

use std::sync::Mutex;
use std::time::Instant;

use tch::Tensor;
use tchmem_wire::compare::{CompareRun, PhasePeaks, COMPARE_RUN_MIME};

use crate::busy_time::{self, Activity};
use crate::cuda_stats::{self, DEVICE};
use crate::{alloc_trace, estimate, op_trace, record};

struct State {
    run: CompareRun,
    last: Instant,
    /// The allocator's peaks across the restarts the phase markers make; `None` without CUDA.
    peaks: Option<Peaks>,
    /// Where the watched models' variables were when the run began: the run's own model is the
    /// one that is not there.
    existing: std::collections::HashSet<usize>,
    /// Whether a step past the wanted ones is recorded (see [`begin_recording_ops`]).
    record_ops: bool,
    /// Whether the GPU's work is being profiled now (the step after the recorded one).
    profiling: bool,
    /// Whether a recording is on now.
    recording: bool,
    /// Whether a timed step marked its optimizer step (`tchmem::phase::step`).
    saw_step_marker: bool,
    /// Whether the step now running times its optimizer step: one after the profiled step, in
    /// a run that records its operators, when the loop marks that step. Its marker waits for
    /// the GPU, which no other step does (the host queues the optimizer's kernels while the
    /// GPU still runs backward in the loop as written).
    timing_optimizer: bool,
    /// When that step reached its optimizer step's marker (the GPU's work before it done).
    step_marked: Option<Instant>,
    /// While the allocator's events are logged (from the beginning of a run that records its
    /// operators on CUDA to the end of the recorded step): the segments held at the beginning.
    alloc_segments: Option<Vec<tchmem_wire::alloc_trace::Segment>>,
    /// Whether a step ended and the next has not begun.
    step_ended: bool,
    /// Allocated bytes when the last step after another began (its forward marker): what
    /// outlives a step. At a step's end the loop's own locals (a style transfer's every layer's
    /// output) are still alive.
    between_steps: Option<u64>,
}

/// The part of a training step between two phase markers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// `phase::forward` to `phase::step`.
    ForwardBackward,
    /// `phase::step` to `phase::end`.
    Step,
}

/// Peaks kept while the markers restart the allocator's.
struct Peaks {
    /// Highest allocated bytes before the last restart.
    allocated: u64,
    /// Highest reserved bytes before the last restart.
    reserved: u64,
    /// The part of the step since the last marker (`None`: outside the marked parts).
    part: Option<Part>,
    /// Highest allocated bytes in that part before restarts an operator recording made.
    part_carried: u64,
}

impl Peaks {
    /// Takes back the peaks an operator recording restarted.
    fn fold_carried(&mut self) {
        let (allocated, reserved) = op_trace::take_carried();
        self.allocated = self.allocated.max(allocated);
        self.reserved = self.reserved.max(reserved);
        self.part_carried = self.part_carried.max(allocated);
    }
}

// One cell runs begin, the loop and finish: a cell's own copy of this static is enough.
static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state() -> std::sync::MutexGuard<'static, Option<State>> {
    crate::state::lock(&STATE)
}

fn synchronize() {
    if tch::Cuda::is_available() {
        tch::Cuda::synchronize(DEVICE);
    }
}

/// The seed both runs of a comparison start from.
pub const SEED: i64 = 0;

/// Starts a run of `steps` steps: seeds libtorch's generators with [`SEED`] (both versions
/// initialise the same weights and draw the same dropout masks, so their losses can be compared
/// step by step), frees the allocator's cache and resets its peaks, so that runs measured one
/// after the other start alike.
pub fn begin(steps: usize) {
    start(steps, false)
}

/// [`begin`], and two steps more past the `steps` timed ones (CUDA only; their times and losses
/// are not the run's): one whose operators are recorded with their bytes, then one whose GPU
/// work is profiled for its busy time: a trial of the memory estimate, which lines up two
/// trials' operators and replays some at the batch it predicts (`tchmem::op_trace`), and draws
/// the step time's line through the GPU's work. A loop that ends before a step records nothing
/// of it.
pub fn begin_recording_ops(steps: usize) {
    start(steps, tch::Cuda::is_available())
}

fn start(steps: usize, record_ops: bool) {
    tch::manual_seed(SEED);
    synchronize();
    let _ = cuda_stats::empty_cache();
    let _ = cuda_stats::reset_peak_stats(DEVICE);
    let allocated_at_begin = cuda_stats::device_stats(DEVICE)
        .ok()
        .map(|stats| stats.current.allocated);
    // A profile an earlier run left on (interrupted in its profiled step) would refuse this one's.
    busy_time::abandon();
    // Dropping an earlier run's unfinished log first.
    if let Some(segments) = state().as_mut().and_then(|s| s.alloc_segments.take()) {
        alloc_trace::stop(segments);
    }
    let alloc_segments = if record_ops {
        alloc_trace::start()
    } else {
        None
    };
    *state() = Some(State {
        run: CompareRun {
            steps_wanted: steps,
            allocated_at_begin,
            cudnn_benchmark: allocated_at_begin.is_some() && crate::cudnn::benchmark(),
            ..Default::default()
        },
        last: Instant::now(),
        peaks: allocated_at_begin.map(|_| Peaks {
            allocated: 0,
            reserved: 0,
            part: None,
            part_carried: 0,
        }),
        // A model kept for the run (made in an earlier cell) is the run's own.
        existing: &estimate::watched_addresses() - &crate::keep::kept_addresses(),
        record_ops,
        profiling: false,
        recording: false,
        saw_step_marker: false,
        timing_optimizer: false,
        step_marked: None,
        alloc_segments,
        step_ended: false,
        between_steps: None,
    });
}

/// Called by the forward marker, at the start of a step: after a step, what is allocated is what
/// outlived it (parameters, gradients, optimizer state, the next batch).
pub(crate) fn at_step_start() {
    let mut guard = state();
    let Some(state) = guard.as_mut().filter(|s| s.step_ended && s.peaks.is_some()) else {
        return;
    };
    state.step_ended = false;
    if let Ok(stats) = cuda_stats::device_stats(DEVICE) {
        state.between_steps = Some(stats.current.allocated);
    }
}

/// Called by each phase marker, before it takes its own lock: during a run on CUDA, the
/// allocator's peak since the previous marker goes to the part of the step that just ended, and
/// the peaks restart for `next` (`None`: outside the marked parts). Elsewhere it does nothing.
/// The allocator's counters are kept on the host: no synchronisation is needed.
pub(crate) fn at_marker(next: Option<Part>) {
    let mut guard = state();
    let Some(state) = guard.as_mut() else { return };
    if next == Some(Part::Step) {
        state.saw_step_marker = true;
        // The optimizer part starts once the GPU is done with the micro-batches before it:
        // with accumulation it runs once for several of them.
        if state.timing_optimizer {
            synchronize();
            state.step_marked = Some(Instant::now());
        }
    }
    let Some(peaks) = state.peaks.as_mut() else {
        return;
    };
    let Ok(stats) = cuda_stats::device_stats(DEVICE) else {
        return;
    };
    peaks.fold_carried();
    peaks.allocated = peaks.allocated.max(stats.peak.allocated);
    peaks.reserved = peaks.reserved.max(stats.peak.reserved);
    if let Some(part) = peaks.part {
        let phase_peaks = state
            .run
            .phase_peaks
            .get_or_insert_with(PhasePeaks::default);
        let peak = match part {
            Part::ForwardBackward => &mut phase_peaks.forward_backward,
            Part::Step => &mut phase_peaks.step,
        };
        *peak = (*peak).max(stats.peak.allocated).max(peaks.part_carried);
    }
    let _ = cuda_stats::reset_peak_stats(DEVICE);
    peaks.part = next;
    peaks.part_carried = 0;
}

/// Called where the training loop's body begins (the compared code of both sides has it):
/// what is allocated there, once a step has ended, is what outlived it. A loop without the
/// phase markers of a rewrite (the original side) is read here rather than at the end of its
/// step, where the step's own locals (a style transfer's every layer's output) are alive.
/// Outside a run it does nothing.
pub fn step_begins() {
    at_step_start();
}

/// Notes one optimizer step and its loss; true once the run has its steps (the loop stops).
/// Outside a run it does nothing and returns false.
pub fn record_step(loss: &Tensor) -> bool {
    let mut guard = state();
    let Some(state) = guard.as_mut() else {
        return false;
    };
    // The recorded step, one past the steps wanted, ends here (reading the loss is not the
    // loop's). Its memory is any step's and counts; its time and loss do not (the recording
    // slows every operator). One step more follows, with the GPU's work profiled.
    if state.recording {
        state.recording = false;
        state.record_ops = false;
        state.run.ops = op_trace::stop().ok();
        state.run.allocations = state.alloc_segments.take().map(alloc_trace::stop);
        synchronize();
        measure(state);
        state.profiling = busy_time::wanted() && busy_time::start(Activity::Device).is_ok();
        // Without a profiled step, the one that times the optimizer step comes next.
        state.timing_optimizer = !state.profiling && state.saw_step_marker;
        return !state.profiling && !state.timing_optimizer;
    }
    // The step that timed its optimizer step, the last, ends here; its time and loss are not
    // the run's (its marker waited for the GPU).
    if state.timing_optimizer {
        let _ = loss.double_value(&[]);
        synchronize();
        if let Some(marked) = state.step_marked.take() {
            state
                .run
                .optimizer_step_seconds
                .push(marked.elapsed().as_secs_f64());
        }
        state.timing_optimizer = false;
        measure(state);
        return true;
    }
    // The profiled step ends here: the GPU's busy time is the run's; the step's time and loss
    // are not (the profiler slows the host). Last, so that a loop too short for it still has
    // its recorded operators.
    if state.profiling {
        synchronize();
        state.profiling = false;
        state.run.gpu_busy_seconds = busy_time::stop(Activity::Device)
            .ok()
            .filter(|busy| busy.events > 0)
            .map(|busy| busy.time.as_secs_f64());
        measure(state);
        // One step more where the loop marks its optimizer step, to time it: last, so that a
        // loop too short for it keeps what came before.
        state.timing_optimizer = state.saw_step_marker;
        return !state.timing_optimizer;
    }
    // The loss value waits for the step's kernels, so the time is the step's.
    let value = loss.double_value(&[]);
    synchronize();
    let now = Instant::now();
    state.run.losses.push(value);
    state
        .run
        .step_seconds
        .push(now.duration_since(state.last).as_secs_f64());
    let done = state.run.losses.len() >= state.run.steps_wanted;
    // The live view under the run shows its step of the steps wanted, and the loss.
    let live = crate::interrupt::run_state();
    live.set_progress(
        state.run.losses.len() as u64,
        Some(state.run.steps_wanted as u64),
    );
    live.set_loss(value);
    if state.run.parameters.is_empty() {
        // The stores are dropped before `finish`; their shapes do not change between steps.
        // Models the notebook held before the run are not the loop's.
        state.run.parameters = estimate::watched_shapes(&state.existing);
    }
    // After every step, so that a loop with fewer steps than asked still has its numbers.
    measure(state);
    // Measuring is not part of the next step's time.
    state.last = Instant::now();
    if done && state.record_ops {
        // One step more, with its operators recorded.
        state.recording = op_trace::start().is_ok();
        return !state.recording;
    }
    done
}

/// The allocator's peaks since the run began and what a step leaves allocated, as of now.
fn measure(state: &mut State) {
    state.step_ended = true;
    if let Some(peaks) = state.peaks.as_mut() {
        peaks.fold_carried();
    }
    let run = &mut state.run;
    if let Ok(stats) = cuda_stats::device_stats(DEVICE) {
        let (allocated, reserved) = state
            .peaks
            .as_ref()
            .map_or((0, 0), |p| (p.allocated, p.reserved));
        run.peak_allocated = Some(stats.peak.allocated.max(allocated));
        run.peak_reserved = Some(stats.peak.reserved.max(reserved));
        run.allocated_after_step = Some(stats.current.allocated);
    }
    run.at_last_step = Some(record::current());
}

/// Ends the run; the value shows as the run's measurements (the kernel reads them).
pub fn finish() -> Finished {
    let mut state = state().take();
    if let Some(state) = state.as_mut().filter(|s| s.profiling) {
        // The loop stopped before the profiled step's end: its kernels finish before the
        // profiler flushes.
        synchronize();
        let _ = busy_time::stop(Activity::Device);
        state.profiling = false;
    }
    if let Some(state) = state.as_mut().filter(|s| s.recording) {
        // The loop stopped before the recorded step's end.
        let _ = op_trace::stop();
        state.recording = false;
    }
    if let Some(segments) = state.as_mut().and_then(|s| s.alloc_segments.take()) {
        alloc_trace::stop(segments);
    }
    if let Some(state) = state.as_mut() {
        // Also where the cell itself turned the mode on, after the run began.
        state.run.cudnn_benchmark |= state.peaks.is_some() && crate::cudnn::benchmark();
        if let Some(between) = state.between_steps {
            state.run.allocated_after_step = Some(between);
        }
    }
    Finished(state.map(|s| s.run).unwrap_or_default())
}

/// A finished run, shown to the kernel as [`COMPARE_RUN_MIME`].
pub struct Finished(pub CompareRun);

impl Finished {
    /// evcxr's hook for showing a cell's value.
    pub fn evcxr_display(&self) {
        crate::display::json_result(COMPARE_RUN_MIME, &self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn::{self, Module, OptimizerConfig};
    use tch::{Device, Kind};

    /// Runs `step` as an instrumented loop does, until [`record_step`] stops it (at most 100
    /// steps): how many ran.
    fn steps_until_stopped(mut step: impl FnMut() -> Tensor) -> usize {
        (1..=100).find(|_| record_step(&step())).unwrap_or(100)
    }

    #[test]
    fn a_trial_times_its_steps_then_records_one_and_profiles_one() {
        // A trial as on CUDA (the kernel asks for it only there); on this CPU the profiler sees
        // no device work, and the steps still run in that order.
        let _profile = crate::busy_time::one_profile_at_a_time();
        let vs = nn::VarStore::new(Device::Cpu);
        let model = nn::linear(vs.root(), 4, 1, Default::default());
        let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
        let x = Tensor::randn([32, 4], (Kind::Float, Device::Cpu));
        start(2, true);
        let steps = steps_until_stopped(|| {
            let loss = model.forward(&x).mean(Kind::Float);
            opt.backward_step(&loss);
            loss
        });
        let run = finish().0;
        assert_eq!(steps, 4, "two timed, one recorded, one profiled");
        assert_eq!(run.losses.len(), 2);
        assert_eq!(run.step_seconds.len(), 2);
        assert!(run.ops.is_some_and(|ops| !ops.ops.is_empty()));
        assert_eq!(run.gpu_busy_seconds, None, "no device here");
        assert!(
            run.optimizer_step_seconds.is_empty(),
            "no step marked: no step to time it"
        );
    }

    /// A training step whose optimizer step is marked as `tchmem::phase` marks it (the markers
    /// call [`at_marker`]; calling it here keeps this module below `phase`).
    fn marked_step(opt: &mut nn::Optimizer, model: &nn::Linear, x: &Tensor) -> Tensor {
        at_marker(Some(Part::ForwardBackward));
        let loss = model.forward(x).mean(Kind::Float);
        opt.zero_grad();
        loss.backward();
        at_marker(Some(Part::Step));
        opt.step();
        at_marker(None);
        loss
    }

    #[test]
    fn a_marked_optimizer_step_is_timed_in_a_step_of_its_own_after_the_others() {
        let _profile = crate::busy_time::one_profile_at_a_time();
        let vs = nn::VarStore::new(Device::Cpu);
        let model = nn::linear(vs.root(), 4, 1, Default::default());
        let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
        let x = Tensor::randn([32, 4], (Kind::Float, Device::Cpu));
        start(3, true);
        let steps = steps_until_stopped(|| marked_step(&mut opt, &model, &x));
        let run = finish().0;
        assert_eq!(
            steps, 6,
            "three timed, one recorded, one profiled, one timing its optimizer step"
        );
        assert_eq!(run.step_seconds.len(), 3);
        assert_eq!(run.optimizer_step_seconds.len(), 1);
        assert!(run.optimizer_step_seconds[0] > 0.0);
        assert!(run.ops.is_some_and(|ops| !ops.ops.is_empty()));
        // A run that records nothing (a --compare) times no optimizer step.
        start(2, false);
        steps_until_stopped(|| marked_step(&mut opt, &model, &x));
        assert!(finish().0.optimizer_step_seconds.is_empty());
    }
}
