//! What micro-batches add to a step's peak: the gradients.
//!
//! In a plain step the gradients are made in backward, as the activations are freed (tch's
//! `zero_grad` sets them to none), so the step's peak holds those made before it. With
//! micro-batches, the gradients of the earlier ones are alive from the start of the later ones:
//! their peak holds all of them. What that adds depends on where the peak lies: little late in
//! backward (tch::vision's resnet18 on the H200, +6.9% when counted whole), all of them at the
//! end of forward. The trial's allocator events tell it: the recorded step is replayed with its
//! gradients held throughout.

use std::collections::{HashMap, HashSet};

use tchmem_wire::alloc_trace::{AllocEvent, AllocTrace};
use tchmem_wire::estimate::ParamShape;

use super::allocator::rounded;

/// The bytes that holding every gradient through the recorded step adds to its peak allocated,
/// at most the gradients' bytes; `None` without a recorded step or parameters to match.
///
/// The gradients are told apart by size: the step's allocations still alive at its end that
/// each match a parameter, newest first (backward makes the gradients after forward's outputs,
/// which the trace's end may find alive too: the loss, the logits), and those alive when it
/// began and freed in it before its first gradient was made that each match one (the last
/// step's, freed by `zero_grad` after forward). Held, a gradient that backward makes is a
/// temporary added to the held one (`grad += new`), so it counts on top of them while it is made.
pub fn added_by_accumulation(trace: &AllocTrace, parameters: &[ParamShape]) -> Option<u64> {
    let step_begins = trace.marks.first()?.1;
    if parameters.is_empty() || step_begins >= trace.events.len() {
        return None;
    }
    let lives = Lives::of(trace);
    let gradients: u64 = parameters.iter().map(|p| rounded(p.bytes())).sum();
    let is_gradient = lives.gradients(step_begins, trace.events.len(), parameters);
    // The last step's gradients, alive when the step began.
    let mut gradients_alive: u64 = (0..lives.sizes.len())
        .filter(|&k| is_gradient[k] && !lives.made_from(k, step_begins))
        .map(|k| lives.sizes[k])
        .sum();
    // What is alive with every gradient held in place of those alive.
    let held = |alive: u64, gradients_alive: u64| alive.saturating_sub(gradients_alive) + gradients;
    let mut alive = lives.alive_before(step_begins);
    let (mut plain_peak, mut held_peak) = (alive, held(alive, gradients_alive));
    for (at, event) in trace.decoded().enumerate().skip(step_begins) {
        match event {
            AllocEvent::Alloc(_) => {
                let k = lives.allocation_at[at];
                alive += lives.sizes[k];
                if is_gradient[k] {
                    // Held, this is `new` in `grad += new`, on top of every gradient.
                    held_peak = held_peak.max(held(alive, gradients_alive));
                    gradients_alive += lives.sizes[k];
                }
            }
            AllocEvent::Free(k) if lives.spans.get(k).is_some_and(|span| span.1 == Some(at)) => {
                alive -= lives.sizes[k];
                if is_gradient[k] {
                    gradients_alive -= lives.sizes[k];
                }
            }
            // A free the trace cannot place (twice, or of a number it never made).
            AllocEvent::Free(_) => continue,
        }
        plain_peak = plain_peak.max(alive);
        held_peak = held_peak.max(held(alive, gradients_alive));
    }
    Some(held_peak.saturating_sub(plain_peak).min(gradients))
}

/// The allocator's events of a plain trial's loop (from its beginning to the end of its
/// recorded step, at any sizes: `events`, numbered as `trace`'s) with each step split into `k`
/// micro-batches, as the kernel's `--accumulate` rewrite runs it: `zero_grad` first, so the
/// last step's gradients are freed before the first micro-batch's forward pass (a plain step
/// frees them after it, and its backward pass puts the new ones in their blocks), then the step
/// once per micro-batch; from the second on, each gradient backward makes is a temporary added
/// into the one the first made, and the tensors a micro-batch leaves alive (its loss, its
/// output) are freed where the next frees the last step's, or as it begins where the step
/// frees none of their size (the loop dropped the last step's before its first operator).
/// What a step makes after its gradients that no later event frees (the optimizer's state, made
/// by its first step) is made once, by the last micro-batch. The steps before the recorded one
/// run as they ran, or split as it is ([`Earlier`]). `None` without a recorded step or
/// parameters, or with `events` not the trace's.
pub fn micro_batched(
    trace: &AllocTrace,
    parameters: &[ParamShape],
    events: &[AllocEvent],
    k: u64,
    earlier: Earlier,
) -> Option<Vec<AllocEvent>> {
    let recorded = trace.marks.first()?.1;
    if parameters.is_empty()
        || events.len() != trace.events.len()
        || recorded >= events.len()
        || k < 2
    {
        return None;
    }
    let lives = Lives::of(trace);
    let starts = match earlier {
        Earlier::AsTheyRan => vec![recorded],
        Earlier::Split => step_starts(trace, recorded),
    };
    let mut out: Vec<Made> = events[..starts[0]]
        .iter()
        .enumerate()
        .map(|(at, event)| Made::of(*event, lives.allocation_at[at]))
        .collect();
    let mut numbers = Numbers {
        now: HashMap::new(),
        traced: lives.sizes.len(),
        next: lives.sizes.len(),
    };
    for (i, &begins) in starts.iter().enumerate() {
        let ends = starts.get(i + 1).copied().unwrap_or(events.len());
        let step = Step::of(&lives, begins..ends, events.len(), parameters);
        step.split(events, k, &mut numbers, &mut out);
    }
    Some(Made::numbered(&out, lives.held_at_start()))
}

/// An event of the split loop, its allocation named by the number it has in the trace (the
/// first micro-batch's) or by a number after the trace's (a later micro-batch's copy).
#[derive(Debug, Clone, Copy)]
enum Made {
    Alloc(usize, u64),
    Free(usize),
}

impl Made {
    /// The trace's event; `number` is the allocation's where it is one.
    fn of(event: AllocEvent, number: usize) -> Made {
        match event {
            AllocEvent::Alloc(bytes) => Made::Alloc(number, bytes),
            AllocEvent::Free(k) => Made::Free(k),
        }
    }

    /// The events as the allocator takes them: allocations numbered in order after the
    /// `held` blocks in use at the start.
    fn numbered(events: &[Made], held: usize) -> Vec<AllocEvent> {
        let mut order: HashMap<usize, usize> = HashMap::new();
        let mut next = held;
        events
            .iter()
            .map(|event| match *event {
                Made::Alloc(name, bytes) => {
                    order.insert(name, next);
                    next += 1;
                    AllocEvent::Alloc(bytes)
                }
                // One held at the start keeps its number; one never made stays unplaced.
                Made::Free(name) => AllocEvent::Free(match order.get(&name) {
                    Some(&number) => number,
                    None if name < held => name,
                    None => usize::MAX,
                }),
            })
            .collect()
    }
}

/// What becomes of the steps before the recorded one in a replay of a loop that accumulates.
///
/// The first steps make the gradients and the optimizer's state, and set the peak reserved of
/// many loops; they are not recorded (no marks), so where they begin and what they make is
/// read from their requests. Split as the recorded step is, the replay put cifar's resnet under
/// cuDNN's benchmark mode at 338 MiB where its check reserved 340 and the steps as they ran said
/// 392; yet the VGG-style net's at 1102 MiB where the check reserved 1248 and as they ran said
/// 1204 (`results/gpu/2026-12-07-corpus-h100/`). Neither is the better guide over the 44 such
/// checks in the traces of the runs under `results/gpu/`, so the estimate takes both as the
/// ends of its range (`docs/fit.md` gives the counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Earlier {
    /// As the plain trial ran them: only the recorded step split.
    AsTheyRan,
    /// Each split as the recorded step is, found where its first requests recur
    /// ([`step_starts`]).
    Split,
}

/// How many of the recorded step's first requests mark where an earlier step began.
const STEP_HEAD: usize = 8;

/// Where each step of the trace begins, the recorded one last: the earlier ones where the
/// recorded step's first [`STEP_HEAD`] requests recur size for size (a loop's step begins with
/// the same operators: its batch, its first layer), each at least half a recorded step's events
/// after the one before; the frees between two steps' requests stay with the step before, as
/// those before the recorded step's first operator do (beginning each step just after the
/// request before its head instead, a `zero_grad` at the top of the loop would free the last
/// gradients in the step that frees them; the committed traces' `--accumulate 2` checks came
/// out worse that way: cifar_resnet_benchmark +20%, min_gpt +8.9% where it was +0.0%). Only
/// the recorded step where they do not recur.
fn step_starts(trace: &AllocTrace, recorded: usize) -> Vec<usize> {
    let requests: Vec<(usize, u64)> = trace
        .decoded()
        .enumerate()
        .filter_map(|(at, event)| match event {
            AllocEvent::Alloc(bytes) => Some((at, bytes)),
            AllocEvent::Free(_) => None,
        })
        .collect();
    let first = requests.partition_point(|&(at, _)| at < recorded);
    let head: Vec<u64> = requests[first..]
        .iter()
        .take(STEP_HEAD)
        .map(|r| r.1)
        .collect();
    let gap = (trace.events.len() - recorded) / 2;
    // The heads found, by their request's index.
    let mut heads: Vec<usize> = Vec::new();
    if head.len() == STEP_HEAD {
        for j in 0..first.saturating_sub(STEP_HEAD - 1) {
            let at = requests[j].0;
            let recurs = requests[j..j + STEP_HEAD]
                .iter()
                .map(|r| r.1)
                .eq(head.iter().copied());
            let apart = heads
                .last()
                .is_none_or(|&last| at >= requests[last].0 + gap);
            if recurs && apart && at + gap <= recorded {
                heads.push(j);
            }
        }
    }
    if heads.is_empty() {
        return vec![recorded];
    }
    let mut starts: Vec<usize> = heads.into_iter().map(|j| requests[j].0).collect();
    starts.push(recorded);
    starts
}

/// The numbers the allocations of the steps split so far go by: the later micro-batches' copies
/// are numbered after every allocation of the trace, and a step's tensors left for the next
/// step (its loss, its output) are its last micro-batch's copies.
struct Numbers {
    /// An allocation's number now, where a copy stands for it.
    now: HashMap<usize, usize>,
    /// How many allocations the trace knows (held at its start and made in it).
    traced: usize,
    next: usize,
}

impl Numbers {
    /// The number allocation `k` of the trace goes by now; a free the trace cannot place stays
    /// unplaced (never a copy's number).
    fn of(&self, k: usize) -> usize {
        match self.now.get(&k) {
            Some(&now) => now,
            None if k < self.traced => k,
            None => usize::MAX,
        }
    }
}

/// One step of the trace (events `range`), its allocations sorted by what the rewrite does with
/// them.
struct Step<'a> {
    lives: &'a Lives,
    range: std::ops::Range<usize>,
    is_gradient: Vec<bool>,
    /// Made here and freed by a later step, not a gradient (its loss, its output), in order.
    left: Vec<usize>,
    /// Made here after its gradients and never freed, in a step before the recorded one (the
    /// optimizer's state).
    kept: HashSet<usize>,
}

impl<'a> Step<'a> {
    fn of(
        lives: &'a Lives,
        range: std::ops::Range<usize>,
        trace_end: usize,
        parameters: &[ParamShape],
    ) -> Step<'a> {
        let is_gradient = lives.gradients_in(range.clone(), trace_end, parameters);
        let last = range.end == trace_end;
        let made_here = |k: usize| lives.made_in(k, &range);
        let freed_later = |k: usize| lives.spans[k].1.is_some_and(|f| f >= range.end);
        let never_freed = |k: usize| lives.spans[k].1.is_none();
        let survives = |k: usize| if last { never_freed(k) } else { freed_later(k) };
        let all = 0..lives.sizes.len();
        let left = all
            .clone()
            .filter(|&k| made_here(k) && survives(k) && !is_gradient[k])
            .collect();
        // The optimizer's state: what the step makes after its gradients and nothing frees (a
        // workspace made in forward and kept is made by the first micro-batch, as it ran).
        let gradients_made = all
            .clone()
            .filter(|&k| is_gradient[k] && made_here(k))
            .filter_map(|k| lives.spans[k].0)
            .max();
        let after_gradients = |k: usize| {
            gradients_made.is_some_and(|g| lives.spans[k].0.is_some_and(|made| made > g))
        };
        let kept = all
            .filter(|&k| !last && made_here(k) && never_freed(k) && !is_gradient[k])
            .filter(|&k| after_gradients(k))
            .collect();
        Step {
            lives,
            range,
            is_gradient,
            left,
            kept,
        }
    }

    /// Appends the step's events (of the loop's `events`), split into `k` micro-batches, to `out`.
    fn split(&self, events: &[AllocEvent], k: u64, numbers: &mut Numbers, out: &mut Vec<Made>) {
        let events = &events[self.range.clone()];
        let lives = self.lives;
        let made_here = |a: usize| lives.made_in(a, &self.range);
        let is_last_gradient =
            |a: usize| a < self.is_gradient.len() && self.is_gradient[a] && !made_here(a);
        // What the step frees of what the last step left (not gradients), each paired with what
        // this step leaves of that size, in order: a later micro-batch frees the earlier one's.
        let mut leftovers: HashMap<u64, Vec<usize>> = HashMap::new();
        for &a in &self.left {
            leftovers.entry(lives.sizes[a]).or_default().push(a);
        }
        let mut pairs: HashMap<usize, usize> = HashMap::new();
        for event in events {
            if let AllocEvent::Free(a) = *event {
                if a < lives.sizes.len() && !made_here(a) && !self.is_gradient[a] {
                    if let Some(same) = leftovers.get_mut(&lives.sizes[a]).filter(|v| !v.is_empty())
                    {
                        pairs.insert(a, same.remove(0));
                    }
                }
            }
        }
        // The first micro-batch: the last step's gradients freed first, the rest as they ran
        // (what the step keeps is made by the last micro-batch), by their own numbers.
        let zero_grad = events.iter().filter_map(|e| match *e {
            AllocEvent::Free(a) if is_last_gradient(a) => Some(Made::Free(numbers.of(a))),
            _ => None,
        });
        out.extend(zero_grad);
        for (offset, event) in events.iter().enumerate() {
            let number = lives.allocation_at[self.range.start + offset];
            match *event {
                AllocEvent::Free(a) if is_last_gradient(a) => {}
                AllocEvent::Free(a) => out.push(Made::Free(numbers.of(a))),
                AllocEvent::Alloc(_) if self.kept.contains(&number) => {}
                AllocEvent::Alloc(bytes) => out.push(Made::Alloc(number, bytes)),
            }
        }
        let mut earlier: HashMap<usize, usize> = HashMap::new();
        let paired: HashSet<usize> = pairs.values().copied().collect();
        for micro in 1..k {
            let is_last_micro = micro == k - 1;
            // What the earlier micro-batch left that no free in the step stands for (the last
            // step's copy went before the step's first operator): gone as this one begins.
            let unpaired = self.left.iter().filter(|a| !paired.contains(a));
            out.extend(unpaired.map(|a| Made::Free(*earlier.get(a).unwrap_or(a))));
            let mut this: HashMap<usize, usize> = HashMap::new();
            for (offset, event) in events.iter().enumerate() {
                match *event {
                    AllocEvent::Alloc(bytes) => {
                        let old = lives.allocation_at[self.range.start + offset];
                        if self.kept.contains(&old) && !is_last_micro {
                            continue;
                        }
                        out.push(Made::Alloc(numbers.next, bytes));
                        this.insert(old, numbers.next);
                        if self.is_gradient.get(old).copied().unwrap_or(false) {
                            out.push(Made::Free(numbers.next));
                        }
                        numbers.next += 1;
                    }
                    AllocEvent::Free(a) if is_last_gradient(a) => {}
                    AllocEvent::Free(a) => {
                        let freed = match this.get(&a) {
                            Some(&new) => Some(new),
                            // The earlier micro-batch's leftover of this size.
                            None => pairs.get(&a).map(|p| *earlier.get(p).unwrap_or(p)),
                        };
                        out.extend(freed.map(Made::Free));
                    }
                }
            }
            earlier = this;
        }
        // The next step frees the last micro-batch's leftovers; what the step keeps is its.
        for a in self.left.iter().chain(&self.kept) {
            if let Some(&copy) = earlier.get(a) {
                numbers.now.insert(*a, copy);
            }
        }
    }
}

/// Each allocation's rounded size and the events that made and freed it.
struct Lives {
    sizes: Vec<u64>,
    /// (the event that made it, the one that freed it); `None` for the blocks in use when the
    /// trace began, or for one never freed.
    spans: Vec<(Option<usize>, Option<usize>)>,
    /// For each event that is an allocation, the allocation's number.
    allocation_at: Vec<usize>,
}

impl Lives {
    fn of(trace: &AllocTrace) -> Lives {
        let mut sizes: Vec<u64> = trace
            .segments
            .iter()
            .flat_map(|s| s.blocks.iter().filter(|(_, used)| *used).map(|(b, _)| *b))
            .collect();
        let mut spans: Vec<(Option<usize>, Option<usize>)> = vec![(None, None); sizes.len()];
        let mut allocation_at = vec![usize::MAX; trace.events.len()];
        for (at, event) in trace.decoded().enumerate() {
            match event {
                AllocEvent::Alloc(bytes) => {
                    allocation_at[at] = sizes.len();
                    sizes.push(rounded(bytes));
                    spans.push((Some(at), None));
                }
                AllocEvent::Free(k) => {
                    // Only the first free of an allocation the trace knows.
                    if let Some(span) = spans.get_mut(k).filter(|span| span.1.is_none()) {
                        span.1 = Some(at);
                    }
                }
            }
        }
        Lives {
            sizes,
            spans,
            allocation_at,
        }
    }

    /// Whether allocation `k` was made at or after event `at` (not held before it).
    fn made_from(&self, k: usize, at: usize) -> bool {
        self.spans[k].0.is_some_and(|made| made >= at)
    }

    /// How many blocks were in use when the trace began (numbered first).
    fn held_at_start(&self) -> usize {
        self.spans
            .iter()
            .take_while(|span| span.0.is_none())
            .count()
    }

    /// Whether allocation `k` was made by an event of `range`.
    fn made_in(&self, k: usize, range: &std::ops::Range<usize>) -> bool {
        self.spans[k].0.is_some_and(|made| range.contains(&made))
    }

    /// Which allocations are gradients of the recorded step (see [`added_by_accumulation`]),
    /// which runs from `step_begins` to the end of the trace (`trace_end` events).
    fn gradients(
        &self,
        step_begins: usize,
        trace_end: usize,
        parameters: &[ParamShape],
    ) -> Vec<bool> {
        self.gradients_in(step_begins..trace_end, trace_end, parameters)
    }

    /// Which allocations are the gradients of the step of events `step` (of a trace of
    /// `trace_end` events): those it made that outlive it, newest first (the trace's last step:
    /// never freed; an earlier one: freed by a later step, as the optimizer's state is not),
    /// and those alive when it began and freed in it before the first of them was made, each
    /// matching a parameter's size.
    fn gradients_in(
        &self,
        step: std::ops::Range<usize>,
        trace_end: usize,
        parameters: &[ParamShape],
    ) -> Vec<bool> {
        let outlives = |k: usize| match self.spans[k].1 {
            None => step.end == trace_end,
            Some(freed) => freed >= step.end && step.end < trace_end,
        };
        let mut is_gradient = vec![false; self.sizes.len()];
        let mut sizes = SizeCounts::of(parameters);
        let mut first_made = None;
        for k in (0..self.sizes.len()).rev() {
            if self.made_in(k, &step) && outlives(k) && sizes.take(self.sizes[k]) {
                is_gradient[k] = true;
                first_made = self.spans[k].0;
            }
        }
        let mut sizes = SizeCounts::of(parameters);
        for (k, gradient) in is_gradient.iter_mut().enumerate() {
            let freed_before_new = self.spans[k].1.is_some_and(|freed| {
                step.contains(&freed) && first_made.is_none_or(|first| freed < first)
            });
            if !self.made_from(k, step.start) && freed_before_new && sizes.take(self.sizes[k]) {
                *gradient = true;
            }
        }
        is_gradient
    }

    /// Bytes alive just before event `at`.
    fn alive_before(&self, at: usize) -> u64 {
        self.spans
            .iter()
            .zip(&self.sizes)
            .filter(|((made, freed), _)| {
                made.is_none_or(|m| m < at) && freed.is_none_or(|f| f >= at)
            })
            .map(|(_, size)| size)
            .sum()
    }
}

/// A multiset of parameter sizes (rounded as the allocator rounds them).
struct SizeCounts(HashMap<u64, usize>);

impl SizeCounts {
    fn of(parameters: &[ParamShape]) -> SizeCounts {
        let mut counts = HashMap::new();
        for p in parameters {
            *counts.entry(rounded(p.bytes())).or_insert(0) += 1;
        }
        SizeCounts(counts)
    }

    /// Takes one of `size`, if any is left.
    fn take(&mut self, size: u64) -> bool {
        match self.0.get_mut(&size) {
            Some(left) if *left > 0 => {
                *left -= 1;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use tchmem_wire::alloc_trace::Segment;

    use super::*;
    use crate::fit::allocator::{self, SegmentOrder};

    const MIB: u64 = 1 << 20;

    /// Two parameters of 4 MiB each (1024×1024 f32).
    fn parameters() -> Vec<ParamShape> {
        let matrix = ParamShape {
            dims: vec![1024, 1024],
            element_size: 4,
        };
        vec![matrix.clone(), matrix]
    }

    /// A step of two 40 MiB activations and a temporary of `temporary` MiB in backward, made
    /// after the second parameter's gradient and before the first's. Held at the start: the
    /// parameters (allocations 0 and 1) and the last step's gradients (2 and 3), which
    /// `zero_grad` frees before the step's first operator or, as `backward_step` does, after
    /// forward.
    fn step(temporary: u64, zero_grad_after_forward: bool) -> AllocTrace {
        let mib = |n: u64| (n * MIB) as i64;
        let free = |k: i64| -(k + 1);
        let zero_grad = [free(2), free(3)];
        let forward = [mib(40), mib(40)];
        let mut events = Vec::new();
        if !zero_grad_after_forward {
            events.extend(zero_grad);
        }
        let step_begins = events.len();
        // Allocation numbers: activations 4 and 5.
        events.extend(forward);
        if zero_grad_after_forward {
            events.extend(zero_grad);
        }
        // Backward: the second activation freed, the second gradient (6), the temporary (7),
        // the first gradient (8).
        events.extend([free(5), mib(4), mib(temporary), free(7), mib(4), free(4)]);
        AllocTrace {
            segments: vec![Segment {
                large: true,
                blocks: vec![(4 * MIB, true); 4],
            }],
            events,
            marks: vec![(0, step_begins), (-1, step_begins + 2)],
        }
    }

    #[test]
    fn gradients_made_before_a_late_peak_add_nothing_to_it() {
        // Plain: 8 MiB of parameters, one gradient, 40 MiB of activations and the 60 MiB
        // temporary. Held through it, only the other gradient is added.
        for zero_grad_after_forward in [false, true] {
            let trace = step(60, zero_grad_after_forward);
            assert_eq!(
                added_by_accumulation(&trace, &parameters()),
                Some(4 * MIB),
                "zero_grad after forward: {zero_grad_after_forward}"
            );
        }
    }

    #[test]
    fn a_peak_at_the_end_of_forward_gets_every_gradient_unless_the_last_ones_are_still_there() {
        // With a small temporary the peak is the end of forward: the gradients are all added
        // to it, unless zero_grad came after forward, when the last step's were still alive.
        assert_eq!(
            added_by_accumulation(&step(10, false), &parameters()),
            Some(8 * MIB)
        );
        assert_eq!(
            added_by_accumulation(&step(10, true), &parameters()),
            Some(0)
        );
    }

    #[test]
    fn only_tensors_the_size_of_a_parameter_count_as_gradients() {
        // Other shapes of parameter: no allocation is a gradient, every one is added.
        let other = vec![ParamShape {
            dims: vec![3, 1024, 1024],
            element_size: 4,
        }];
        assert_eq!(
            added_by_accumulation(&step(60, false), &other),
            Some(12 * MIB)
        );
        // No recorded step, no event in it, or no parameters: nothing to tell it by.
        let unmarked = AllocTrace {
            marks: vec![],
            ..step(60, false)
        };
        assert_eq!(added_by_accumulation(&unmarked, &parameters()), None);
        let empty = AllocTrace {
            events: vec![],
            ..step(60, false)
        };
        assert_eq!(added_by_accumulation(&empty, &parameters()), None);
        assert_eq!(added_by_accumulation(&step(60, false), &[]), None);
    }

    #[test]
    fn forward_outputs_alive_at_the_end_are_not_taken_for_gradients() {
        // Parameters 0 and 1; the step makes logits of a parameter's size (2, alive at its
        // end, as a loop's `let logits` is), a 40 MiB activation (3), the gradients 4 and 5.
        let mib = |n: u64| (n * MIB) as i64;
        let trace = AllocTrace {
            segments: vec![Segment {
                large: true,
                blocks: vec![(4 * MIB, true); 2],
            }],
            events: vec![mib(4), mib(40), mib(4), -4, mib(4)],
            marks: vec![(0, 0)],
        };
        // Plain, the peak is the first gradient made beside the activation: 56 MiB. Held, the
        // other gradient is there too, and the first is made as a temporary on top of both
        // (`grad += new`): 64 MiB. Taking the logits for a gradient would say 4 MiB.
        assert_eq!(added_by_accumulation(&trace, &parameters()), Some(8 * MIB));
    }

    #[test]
    fn frees_the_trace_cannot_place_are_left_out() {
        // A free of a number never made, and a second free of the first activation (4): the
        // same answer as without them.
        let mut trace = step(60, false);
        trace.events.insert(3, -100);
        trace.events.push(-5);
        assert_eq!(added_by_accumulation(&trace, &parameters()), Some(4 * MIB));
    }

    #[test]
    fn micro_batches_free_the_last_gradients_first_and_keep_the_first_ones() {
        // Parameters 0, 1 and the last gradients 2, 3 fill a 16 MiB segment; forward makes a
        // 40 MiB activation (4), zero_grad frees 2 and 3, backward makes the gradients (5, 6)
        // and frees the activation. Plain, the gradients take the blocks zero_grad freed: 56
        // MiB reserved.
        let mib = |n: u64| (n * MIB) as i64;
        let trace = AllocTrace {
            segments: vec![Segment {
                large: true,
                blocks: vec![(4 * MIB, true); 4],
            }],
            events: vec![mib(40), -3, -4, mib(4), mib(4), -5],
            marks: vec![(0, 0)],
        };
        let events: Vec<AllocEvent> = trace.decoded().collect();
        let two = micro_batched(&trace, &parameters(), &events, 2, Earlier::Split).unwrap();
        let a = |n: u64| AllocEvent::Alloc(n * MIB);
        use AllocEvent::Free;
        // zero_grad first; the second micro-batch's allocations are 7-9, its gradients
        // temporaries added into 5 and 6, its activation freed as the first's was.
        let expected = [
            Free(2),
            Free(3),
            a(40),
            a(4),
            a(4),
            Free(4),
            a(40),
            a(4),
            Free(8),
            a(4),
            Free(9),
            Free(7),
        ];
        assert_eq!(two, expected);
        // The first micro-batch's gradients now fill the freed blocks, and the second's
        // temporary needs a segment of its own (20 MiB for a request of 1-10 MiB).
        let order = SegmentOrder::default();
        let plain = allocator::peak_reserved(&trace.segments, events, order);
        let micro = allocator::peak_reserved(&trace.segments, two, order);
        assert_eq!((plain, micro), (56 * MIB, 76 * MIB));
        // One micro-batch, no recorded step or no parameters: nothing to make.
        assert!(micro_batched(
            &trace,
            &parameters(),
            &trace.decoded().collect::<Vec<_>>(),
            1,
            Earlier::Split
        )
        .is_none());
        assert!(micro_batched(
            &trace,
            &[],
            &trace.decoded().collect::<Vec<_>>(),
            2,
            Earlier::Split
        )
        .is_none());
    }

    #[test]
    fn the_first_step_is_split_too_and_the_optimizers_state_is_made_once() {
        // A 4 MiB parameter held (0). Each step makes eight activations of 1-8 KiB (its head)
        // and frees them; the first then makes the gradient (9) and the momentum (10), which
        // nothing frees; the recorded step frees the last gradient after its forward pass and
        // makes a new one.
        let kib = |n: i64| n * 1024;
        let free = |k: i64| -(k + 1);
        let mut events: Vec<i64> = (1..=8).map(kib).collect();
        events.extend((1..=8).map(free));
        events.extend([4 * MIB as i64, 4 * MIB as i64]);
        let recorded = events.len();
        events.extend((1..=8).map(kib));
        events.push(free(9));
        events.extend((11..=18).map(free));
        events.push(4 * MIB as i64);
        let trace = AllocTrace {
            segments: vec![Segment {
                large: true,
                blocks: vec![(4 * MIB, true)],
            }],
            events,
            marks: vec![(0, recorded)],
        };
        let one = &parameters()[..1];
        let plain: Vec<AllocEvent> = trace.decoded().collect();
        use AllocEvent::{Alloc, Free};
        let head = || (1..=8).map(|n| Alloc(n * 1024));
        let frees = |from: usize| (from..from + 8).map(Free);
        let step =
            |first_acts: usize| -> Vec<AllocEvent> { head().chain(frees(first_acts)).collect() };
        // Split: the first step's second micro-batch makes its gradient as a temporary and the
        // momentum once; the recorded step frees the first step's gradient before its forward.
        let split = micro_batched(&trace, one, &plain, 2, Earlier::Split).unwrap();
        let mut expected = step(1);
        expected.push(Alloc(4 * MIB));
        expected.extend(step(10));
        expected.extend([Alloc(4 * MIB), Free(18), Alloc(4 * MIB)]);
        expected.push(Free(9));
        expected.extend(step(20));
        expected.push(Alloc(4 * MIB));
        expected.extend(step(29));
        expected.extend([Alloc(4 * MIB), Free(37)]);
        assert_eq!(split, expected);
        // As they ran: the first step as the trial ran it, the recorded one split.
        let ran = micro_batched(&trace, one, &plain, 2, Earlier::AsTheyRan).unwrap();
        assert_eq!(ran[..recorded], plain[..recorded]);
        assert_eq!(ran[recorded], Free(9));
        assert_eq!(step_starts(&trace, recorded), vec![0, recorded]);
    }

    #[test]
    fn what_a_micro_batch_leaves_goes_as_the_next_begins_when_the_step_frees_none_of_it() {
        // Held at the start: a 4 MiB parameter (0), its last gradient (1), the last step's
        // 40 MiB output (2), which the loop drops before the step's first operator. The step
        // makes an output (3), frees the last gradient, makes the new one (4). Three
        // micro-batches: each output goes as the next micro-batch begins, one alive at the end.
        let mib = |n: u64| (n * MIB) as i64;
        let trace = AllocTrace {
            segments: vec![Segment {
                large: true,
                blocks: vec![(4 * MIB, true), (4 * MIB, true), (40 * MIB, true)],
            }],
            events: vec![-3, mib(40), -2, mib(4)],
            marks: vec![(0, 1)],
        };
        let one = &parameters()[..1];
        let events: Vec<AllocEvent> = trace.decoded().collect();
        let three = micro_batched(&trace, one, &events, 3, Earlier::Split).unwrap();
        let a = |n: u64| AllocEvent::Alloc(n * MIB);
        use AllocEvent::Free;
        let expected = [
            Free(2),
            Free(1),
            a(40),
            a(4),
            Free(3),
            a(40),
            a(4),
            Free(6),
            Free(5),
            a(40),
            a(4),
            Free(8),
        ];
        assert_eq!(three, expected);
        // Events that are not the trace's: nothing to make.
        assert!(micro_batched(&trace, one, &events[1..], 3, Earlier::Split).is_none());
    }
}
