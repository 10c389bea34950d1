//! What micro-batches add to a step's peak: the gradients.
//!
//! In a plain step the gradients are made in backward, as the activations are freed (tch's
//! `zero_grad` sets them to none), so the step's peak holds those made before it. With
//! micro-batches, the gradients of the earlier ones are alive from the start of the later ones:
//! their peak holds all of them. What that adds depends on where the peak lies: little late in
//! backward (tch::vision's resnet18 on the H200, +6.9% when counted whole), all of them at the
//! end of forward. The trial's allocator events tell it: the recorded step is replayed with its
//! gradients held throughout.

use std::collections::HashMap;

use tchmem_wire::alloc_trace::{AllocEvent, AllocTrace};
use tchmem_wire::estimate::ParamShape;

use super::allocator::rounded;

/// The bytes that holding every gradient through the recorded step adds to its peak allocated,
/// at most the gradients' bytes; `None` without a recorded step or parameters to match.
///
/// The gradients are told apart by size: those of the step's allocations still alive at its
/// end that each match a parameter (the ones it made), and those alive when it began and freed
/// in it that each match one (the last step's, freed by `zero_grad`).
pub fn added_by_accumulation(trace: &AllocTrace, parameters: &[ParamShape]) -> Option<u64> {
    let step_begins = trace.marks.first()?.1;
    if parameters.is_empty() {
        return None;
    }
    let lives = Lives::of(trace);
    let gradients: u64 = parameters.iter().map(|p| rounded(p.bytes())).sum();
    let mut made = SizeCounts::of(parameters);
    let mut last = made.clone();
    // Whether each allocation is a gradient: made in the step and alive at its end, or alive
    // when it began and freed in it.
    let mut is_gradient = vec![false; lives.sizes.len()];
    let mut gradients_alive = 0;
    for (k, &(made_at, freed_at)) in lives.spans.iter().enumerate() {
        let size = lives.sizes[k];
        let made_in_step = made_at.is_some_and(|m| m >= step_begins);
        let freed_in_step = freed_at.is_some_and(|f| f >= step_begins);
        is_gradient[k] = match (made_in_step, freed_at) {
            (true, None) => made.take(size),
            (false, Some(_)) if freed_in_step => last.take(size),
            _ => false,
        };
        if is_gradient[k] && !made_in_step {
            gradients_alive += size;
        }
    }
    let mut alive = lives.alive_before(step_begins);
    let (mut plain_peak, mut held_peak) = (alive, alive - gradients_alive + gradients);
    for (at, event) in trace.decoded().enumerate().skip(step_begins) {
        let (k, grows) = match event {
            AllocEvent::Alloc(_) => (lives.allocation_at[at], true),
            AllocEvent::Free(k) => (k, false),
        };
        let Some(&size) = lives.sizes.get(k) else {
            continue;
        };
        if grows {
            alive += size;
            gradients_alive += if is_gradient[k] { size } else { 0 };
        } else {
            alive = alive.saturating_sub(size);
            gradients_alive -= if is_gradient[k] { size } else { 0 };
        }
        plain_peak = plain_peak.max(alive);
        held_peak = held_peak.max((alive + gradients).saturating_sub(gradients_alive));
    }
    Some(held_peak.saturating_sub(plain_peak).min(gradients))
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
                    if let Some(span) = spans.get_mut(k) {
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
#[derive(Clone)]
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
        // No recorded step, or no parameters: nothing to tell it by.
        let unmarked = AllocTrace {
            marks: vec![],
            ..step(60, false)
        };
        assert_eq!(added_by_accumulation(&unmarked, &parameters()), None);
        assert_eq!(added_by_accumulation(&step(60, false), &[]), None);
    }
}
