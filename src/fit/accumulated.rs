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
    let is_gradient = lives.gradients(step_begins, parameters);
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

/// The allocator's events of a step split into `k` micro-batches, made from a plain trial's
/// (from its beginning to the end of its recorded step, at any sizes: `events`, numbered as
/// `trace`'s), as the kernel's `--accumulate` rewrite runs it: `zero_grad` first, so the last
/// step's gradients are freed before the first micro-batch's forward pass (a plain step frees
/// them after it, and its backward pass puts the new ones in their blocks), then the recorded
/// step once per micro-batch; from the second on, each gradient backward makes is a temporary
/// added into the one the first made, and the tensors a micro-batch leaves alive (its loss,
/// its output) are freed where the next frees the last step's, or as it begins where the
/// recorded step frees none of their size (the loop dropped the last step's before its first
/// operator). `None` without a recorded step or parameters, or with `events` not the trace's.
pub fn micro_batched(
    trace: &AllocTrace,
    parameters: &[ParamShape],
    events: &[AllocEvent],
    k: u64,
) -> Option<Vec<AllocEvent>> {
    let step_begins = trace.marks.first()?.1;
    if parameters.is_empty()
        || events.len() != trace.events.len()
        || step_begins >= events.len()
        || k < 2
    {
        return None;
    }
    let lives = Lives::of(trace);
    let is_gradient = lives.gradients(step_begins, parameters);
    let made_in_step = |k: usize| lives.made_from(k, step_begins);
    // What the step frees of what the last step left (not gradients), each paired with what
    // this step leaves of that size, in order: a later micro-batch frees the earlier one's.
    let left = |k: usize| made_in_step(k) && lives.spans[k].1.is_none() && !is_gradient[k];
    let left_by_step: Vec<usize> = (0..lives.sizes.len()).filter(|&k| left(k)).collect();
    let mut leftovers: HashMap<u64, Vec<usize>> = HashMap::new();
    for &k in &left_by_step {
        leftovers.entry(lives.sizes[k]).or_default().push(k);
    }
    let mut pairs: HashMap<usize, usize> = HashMap::new();
    for event in &events[step_begins..] {
        if let AllocEvent::Free(k) = *event {
            if k < lives.sizes.len() && !made_in_step(k) && !is_gradient[k] {
                if let Some(same) = leftovers.get_mut(&lives.sizes[k]).filter(|v| !v.is_empty()) {
                    pairs.insert(k, same.remove(0));
                }
            }
        }
    }
    let is_last_gradient = |k: usize| k < is_gradient.len() && is_gradient[k] && !made_in_step(k);
    let step = &events[step_begins..];
    let mut out: Vec<AllocEvent> = events[..step_begins].to_vec();
    // The first micro-batch: the last step's gradients freed first.
    let (zero_grad, rest): (Vec<AllocEvent>, Vec<AllocEvent>) = step
        .iter()
        .partition(|e| matches!(**e, AllocEvent::Free(k) if is_last_gradient(k)));
    out.extend(zero_grad);
    out.extend(rest);
    // Each later one, its allocations numbered after every earlier one's.
    let mut next = lives.sizes.len();
    let mut earlier: HashMap<usize, usize> = HashMap::new();
    let paired: HashSet<usize> = pairs.values().copied().collect();
    for _ in 1..k {
        // What the earlier micro-batch left that no free in the step stands for (the last
        // step's copy went before the step's first operator): gone as this one begins.
        let unpaired = left_by_step.iter().filter(|k| !paired.contains(k));
        out.extend(unpaired.map(|k| AllocEvent::Free(*earlier.get(k).unwrap_or(k))));
        let mut this: HashMap<usize, usize> = HashMap::new();
        for (at, event) in step.iter().enumerate() {
            match *event {
                AllocEvent::Alloc(bytes) => {
                    let old = lives.allocation_at[step_begins + at];
                    out.push(AllocEvent::Alloc(bytes));
                    this.insert(old, next);
                    if is_gradient.get(old).copied().unwrap_or(false) {
                        out.push(AllocEvent::Free(next));
                    }
                    next += 1;
                }
                AllocEvent::Free(k) if is_last_gradient(k) => {}
                AllocEvent::Free(k) => {
                    let freed = match this.get(&k) {
                        Some(&new) => Some(new),
                        // The earlier micro-batch's leftover of this size.
                        None => pairs.get(&k).map(|p| *earlier.get(p).unwrap_or(p)),
                    };
                    out.extend(freed.map(AllocEvent::Free));
                }
            }
        }
        earlier = this;
    }
    Some(out)
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

    /// Which allocations are gradients (see [`added_by_accumulation`]): those made from
    /// `step_begins` on and never freed, newest first, and those alive when it began and
    /// freed before the first of them was made, each matching a parameter's size.
    fn gradients(&self, step_begins: usize, parameters: &[ParamShape]) -> Vec<bool> {
        let mut is_gradient = vec![false; self.sizes.len()];
        let mut sizes = SizeCounts::of(parameters);
        let mut first_made = None;
        for k in (0..self.sizes.len()).rev() {
            if self.made_from(k, step_begins)
                && self.spans[k].1.is_none()
                && sizes.take(self.sizes[k])
            {
                is_gradient[k] = true;
                first_made = self.spans[k].0;
            }
        }
        let mut sizes = SizeCounts::of(parameters);
        for (k, gradient) in is_gradient.iter_mut().enumerate() {
            let freed_before_new = self.spans[k].1.is_some_and(|freed| {
                freed >= step_begins && first_made.is_none_or(|first| freed < first)
            });
            if !self.made_from(k, step_begins) && freed_before_new && sizes.take(self.sizes[k]) {
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
        let two = micro_batched(&trace, &parameters(), &events, 2).unwrap();
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
            1
        )
        .is_none());
        assert!(micro_batched(&trace, &[], &trace.decoded().collect::<Vec<_>>(), 2).is_none());
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
        let three = micro_batched(&trace, one, &events, 3).unwrap();
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
        assert!(micro_batched(&trace, one, &events[1..], 3).is_none());
    }
}
