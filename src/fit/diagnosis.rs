//! What an out-of-memory failure says about the cell, and what would make it fit: the state at
//! the failure (libtorch's OOM observer), where the bytes were, and ranked fixes with their
//! predicted savings, each a line to paste.
//!
//! The savings are predictions from the bytes alive at the failure, not measurements: the
//! failure stopped the step part-way, so the activations the step would still have made are
//! unknown. The suggestions say so, and name the magics that measure (`%%optimize --fit`,
//! `%memfit`).

use tchmem_wire::estimate::OptimizerRule;
use tchmem_wire::memory::OomEvent;

use super::candidates::OPTIMIZERS;
use super::estimate::{Calibration, Scenario};
use crate::report::format::human_bytes;
use crate::rewrite::batch::BatchBinding;

/// The optimizer state per byte of (f32) parameters, by the cell's optimizer: Adam's two
/// moments, one momentum buffer, none.
fn state_per_parameter_byte(optimizer: Option<&str>) -> f64 {
    match optimizer {
        Some("Adam" | "AdamW") => 2.0,
        Some("Sgd" | "RmsProp" | "Lion") => 1.0,
        _ => 0.0,
    }
}

/// Fragmentation worth a word: this much reserved but not allocated, and a tenth of what was
/// reserved.
const FRAGMENTED_BYTES: u64 = 1 << 30;

/// What the kernel knows about the failed cell besides the event.
#[derive(Debug, Clone, Default)]
pub struct FailedCell {
    /// The cell's batch-size binding, if it has one.
    pub batch: Option<BatchBinding>,
    /// Its optimizer's tch name (`Adam`, `AdamW`, `Sgd`, …), if it builds one.
    pub optimizer: Option<String>,
    /// Whether the cell has a training step `%%optimize` can rewrite.
    pub trains: bool,
}

/// One fix, ranked.
#[derive(Debug, Clone, PartialEq)]
pub struct Suggestion {
    /// The line to paste above the cell (or the binding to change).
    pub line: String,
    /// Predicted saving in bytes (an upper bound where the text says "up to").
    pub saving: u64,
    /// What the prediction rests on.
    pub why: String,
    /// Whether the saving covers the shortfall.
    pub covers: bool,
}

/// The diagnosis of one failure.
#[derive(Debug, Clone, PartialEq)]
pub struct Diagnosis {
    /// What was alive and where, at the failure, as lines.
    pub state: Vec<String>,
    /// The fixes, best first.
    pub suggestions: Vec<Suggestion>,
    /// Advice about fragmentation, if there was much.
    pub fragmentation: Option<String>,
}

/// Explains `event` (the observer's last) for `cell`.
pub fn diagnose(event: &OomEvent, cell: &FailedCell) -> Diagnosis {
    let allocated = event.allocated.unwrap_or(0);
    let reserved = event.reserved.unwrap_or(allocated);
    let parameters = event.parameters.unwrap_or(0);
    let gradients = event.gradients.unwrap_or(0);
    let input = event.input_batch.unwrap_or(0);
    let state = (parameters as f64 * state_per_parameter_byte(cell.optimizer.as_deref())) as u64;
    // What the allocator could still have taken: the device's free memory, within its limit
    // (a memory fraction, or the device's size).
    let room = event
        .device_free
        .min(event.device_total.saturating_sub(reserved));
    let shortfall = event.requested.saturating_sub(room);
    let rest = allocated.saturating_sub(parameters + gradients + input);
    // What the step made besides the model's own tensors (bounded by what is left).
    let activations = rest.saturating_sub(state);
    let mut lines = vec![format!(
        "The failed request: {}, with {} free on the device and an allocator limit of {}; {} \
         allocated, {} reserved at that moment.",
        human_bytes(event.requested),
        human_bytes(event.device_free),
        human_bytes(event.device_total),
        human_bytes(allocated),
        human_bytes(reserved),
    )];
    if event.allocated.is_some() {
        lines.push(alive_line(
            parameters,
            gradients,
            input,
            state,
            activations,
            cell,
        ));
    }
    let suggestions = if cell.trains && activations > 0 {
        fixes(cell, shortfall.max(1), activations, parameters, state)
    } else {
        Vec::new()
    };
    Diagnosis {
        state: lines,
        suggestions,
        fragmentation: fragmentation_advice(reserved, allocated),
    }
}

/// What was alive at the failure, by category, in words.
fn alive_line(
    parameters: u64,
    gradients: u64,
    input: u64,
    state: u64,
    activations: u64,
    cell: &FailedCell,
) -> String {
    let mut parts = Vec::new();
    for (label, bytes) in [
        ("parameters", parameters),
        ("gradients", gradients),
        ("input batch", input),
    ] {
        if bytes > 0 {
            parts.push(format!("{label} {}", human_bytes(bytes)));
        }
    }
    if state > 0 {
        parts.push(format!(
            "optimizer state ≈ {} ({}'s rule, once it has stepped)",
            human_bytes(state),
            cell.optimizer.as_deref().unwrap_or_default()
        ));
    }
    parts.push(format!(
        "activations and other tensors {}",
        human_bytes(activations)
    ));
    format!("Alive at the failure: {}.", parts.join(", "))
}

/// Advice when much of what was reserved was not allocated (cached blocks the request could
/// not use).
fn fragmentation_advice(reserved: u64, allocated: u64) -> Option<String> {
    let fragmentation = reserved.saturating_sub(allocated);
    (fragmentation >= FRAGMENTED_BYTES && fragmentation * 10 >= reserved).then(|| {
        format!(
            "{} was reserved but not allocated at the failure (cached blocks too small or \
                 split for the request). `%memfree` empties the cache; setting \
                 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the kernel's environment \
                 (then restarting it) lets segments grow instead of fragmenting ({}).",
            human_bytes(fragmentation),
            crate::report::EXPANDABLE_SEGMENTS_MEASURED
        )
    })
}

/// The fixes for a training cell that needed `need` more bytes, covering ones first; among
/// them the order below (faster or exact ones first).
fn fixes(
    cell: &FailedCell,
    need: u64,
    activations: u64,
    parameters: u64,
    state: u64,
) -> Vec<Suggestion> {
    let mut suggestions = Vec::new();
    // bf16 halves the saved activations but keeps bf16 copies of the weights for backward.
    let bf16 = (activations / 2).saturating_sub(parameters / 2);
    if bf16 > 0 {
        suggestions.push(Suggestion {
            line: "%%optimize --amp bf16".into(),
            saving: bf16,
            why: "about half the activations, less the bf16 copies of the weights".into(),
            covers: bf16 >= need,
        });
    }
    if let Some(k) = [2u64, 4, 8, 16]
        .into_iter()
        .find(|k| activations - activations / k >= need)
    {
        let saving = activations - activations / k;
        suggestions.push(Suggestion {
            line: format!("%%optimize --accumulate {k}"),
            saving,
            why: format!("1/{k} of the activations per micro-batch, same effective batch"),
            covers: true,
        });
    }
    suggestions.push(Suggestion {
        line: "%%optimize --checkpoint".into(),
        saving: activations,
        why: "up to the activations: only each segment's input is kept (costs a second \
                  forward pass)"
            .into(),
        covers: activations >= need,
    });
    if state > 0 {
        let saving = state - state / 100;
        suggestions.push(Suggestion {
            line: "%%optimize --optimizer adafactor".into(),
            saving,
            why: "the optimizer state, factored (a different optimizer)".into(),
            covers: saving >= need,
        });
    }
    if let Some(binding) = &cell.batch {
        let per_sample = activations / binding.value.max(1);
        if per_sample > 0 && binding.value > 1 {
            let fewer = need.div_ceil(per_sample).max(1);
            if fewer < binding.value {
                let batch = binding.value - fewer;
                suggestions.push(Suggestion {
                    line: binding.written(batch),
                    saving: fewer * per_sample,
                    why: format!(
                        "{} of activations per sample at the failure (line {}); at least \
                             this much smaller",
                        human_bytes(per_sample),
                        binding.line
                    ),
                    covers: true,
                });
            }
        }
    }
    suggestions.sort_by_key(|s| !s.covers);
    suggestions
}

/// Fixes measured, not guessed: from a calibration of the failed cell (two short trials at
/// smaller batches, see [`crate::fit::estimate`]), the predicted peak of the loop as written at
/// its batch, and of each fix the calibration can predict (a smaller batch, micro-batches, a
/// leaner optimizer), against `limit` (what the allocator may reserve). Fitting ones first. A fix
/// covers the failure when the high end of its peak reserved range fits (the cell just ran out
/// of memory: a line to paste must not do so again where the point was optimistic).
pub fn measured_fixes(
    calibration: &Calibration,
    binding: &BatchBinding,
    rule: OptimizerRule,
    begin: u64,
    limit: u64,
) -> (u64, Vec<Suggestion>) {
    // (point, high end) of the predicted peak reserved.
    let predict = |batch: u64, accumulate: u64, rule: OptimizerRule| {
        calibration
            .predict(&Scenario {
                batch,
                accumulate,
                rule,
                begin,
                zero_ranks: None,
            })
            .map_or((u64::MAX, u64::MAX), |p| {
                (p.peak_reserved, p.peak_reserved_high())
            })
    };
    let (needed, _) = predict(binding.value, 1, rule);
    let mut fixes = Vec::new();
    let mut push = |line: String, (peak, high): (u64, u64), why: String| {
        let range = if high > peak {
            format!(" (up to {} by its range)", human_bytes(high))
        } else {
            String::new()
        };
        fixes.push(Suggestion {
            line,
            saving: needed.saturating_sub(peak),
            why: format!("predicted peak {}{range}; {why}", human_bytes(peak)),
            covers: high <= limit,
        })
    };
    // The predicted peak grows with the batch: the largest that fits by bisection.
    let fits_at = |batch: u64, accumulate: u64, rule: OptimizerRule| {
        predict(batch, accumulate, rule).1 <= limit
    };
    let (mut fits, mut too_big) = (0u64, binding.value);
    while too_big - fits > 1 {
        let mid = fits + (too_big - fits) / 2;
        if fits_at(mid, 1, rule) {
            fits = mid;
        } else {
            too_big = mid;
        }
    }
    if let Some(batch) = (fits > 0).then_some(fits) {
        push(
            binding.written(batch),
            predict(batch, 1, rule),
            "the largest batch predicted to fit (`%memfit` confirms it)".into(),
        );
    }
    if let Some(k) = [2u64, 4, 8, 16]
        .into_iter()
        .filter(|&k| k <= binding.value)
        .find(|&k| fits_at(binding.value, k, rule))
    {
        push(
            format!("%%optimize --accumulate {k}"),
            predict(binding.value, k, rule),
            "the same effective batch".into(),
        );
    }
    for (choice, other) in OPTIMIZERS {
        if other != rule {
            push(
                format!("%%optimize --optimizer {}", choice.flag_value()),
                predict(binding.value, 1, other),
                format!(
                    "{}'s state by its rule (a different optimizer)",
                    other.label()
                ),
            );
        }
    }
    fixes.sort_by_key(|s| !s.covers);
    (needed, fixes)
}

impl Diagnosis {
    /// The diagnosis as text, for the error's message.
    pub fn text(&self, cell: &FailedCell) -> String {
        let mut out = self.state.join("\n");
        if let Some(advice) = &self.fragmentation {
            out.push_str(&format!("\nFragmentation: {advice}"));
        }
        if !self.suggestions.is_empty() {
            out.push_str(
                "\nWhat would make it fit (predicted from the bytes alive at the failure; the \
                 rest of the step is unknown):",
            );
            for (i, s) in self.suggestions.iter().enumerate() {
                out.push_str(&format!(
                    "\n  {}. {:<36} −{}{}  ({})",
                    i + 1,
                    s.line,
                    human_bytes(s.saving),
                    if s.covers { "" } else { ", not enough alone" },
                    s.why
                ));
            }
        }
        if cell.trains {
            out.push_str(
                "\nTo measure instead of predict: `%%optimize --fit device` above this cell tries \
                 the combinations in short trials and runs the fastest that fits; `%memfit` \
                 finds the largest batch that fits.",
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn event() -> OomEvent {
        OomEvent {
            device: 0,
            requested: 4 * GIB,
            device_total: 16 * GIB,
            device_free: GIB,
            allocated: Some(14 * GIB),
            reserved: Some(15 * GIB),
            parameters: Some(GIB),
            gradients: Some(GIB),
            input_batch: None,
        }
    }

    fn cell() -> FailedCell {
        FailedCell {
            batch: crate::rewrite::batch::find("let batch_size = 32;").ok(),
            optimizer: Some("Adam".into()),
            trains: true,
        }
    }

    #[test]
    fn an_oom_is_explained_with_ranked_fixes_that_cover_the_shortfall() {
        let diagnosis = diagnose(&event(), &cell());
        // 14 GiB allocated: 1 + 1 of model tensors, ≈ 2 of Adam state, 10 of activations; 1 GiB
        // free of a 16 GiB limit with 15 reserved: 3 GiB short.
        let text = diagnosis.text(&cell());
        assert!(
            text.contains("activations and other tensors 10.0 GiB"),
            "{text}"
        );
        assert!(text.contains("optimizer state ≈ 2.0 GiB"), "{text}");
        let lines: Vec<&str> = diagnosis
            .suggestions
            .iter()
            .map(|s| s.line.as_str())
            .collect();
        assert_eq!(
            lines,
            [
                "%%optimize --amp bf16",
                "%%optimize --accumulate 2",
                "%%optimize --checkpoint",
                "let batch_size = 22;",
                "%%optimize --optimizer adafactor",
            ]
        );
        assert!(diagnosis.suggestions[..4].iter().all(|s| s.covers));
        assert!(!diagnosis.suggestions[4].covers);
        assert!(text.contains("%%optimize --fit device"));
        assert!(diagnosis.fragmentation.is_none());
    }

    #[test]
    fn measured_fixes_come_from_the_calibrations_line() {
        const MIB: u64 = 1 << 20;
        let rule = OptimizerRule::Adam;
        let sim = crate::fit::estimate::tests::simulated;
        let calibration = Calibration {
            points: vec![(16, sim(16, 0, &rule)), (32, sim(32, 0, &rule))],
            rule,
            gradients_in_backward: false,
            replayed: None,
        };
        let binding = crate::rewrite::batch::find("let batch_size = 64;").unwrap();
        // At 64 the simulated loop reserves ~300 MiB; give it 200 MiB.
        let limit = 200 * MIB;
        let (needed, fixes) = measured_fixes(&calibration, &binding, rule, 0, limit);
        assert!(needed > limit);
        let batch = fixes
            .iter()
            .find(|f| f.line.starts_with("let batch_size"))
            .unwrap();
        assert!(batch.covers);
        let n: u64 = batch
            .line
            .trim_end_matches(';')
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(sim(n, 0, &rule).peak_reserved <= limit);
        assert!(
            sim(n + 1, 0, &rule).peak_reserved > limit,
            "{n} is not the largest"
        );
        assert!(fixes
            .iter()
            .any(|f| f.line == "%%optimize --accumulate 2" && f.covers));
        assert!(fixes.iter().take_while(|f| f.covers).count() >= 2);
        // A batch of a billion is bisected, not walked down one by one.
        let huge = crate::rewrite::batch::find("let batch_size = 1000000000;").unwrap();
        let (_, fixes) = measured_fixes(&calibration, &huge, rule, 0, limit);
        assert!(fixes
            .iter()
            .any(|f| f.line == format!("let batch_size = {n};")));
    }

    #[test]
    fn a_measured_fix_covers_the_failure_only_at_the_high_end_of_its_range() {
        const MIB: u64 = 1 << 20;
        let rule = OptimizerRule::Adam;
        let sim = crate::fit::estimate::tests::simulated;
        // The smaller trial cached as much as it allocated, the larger a tenth: the prediction's
        // peak reserved is a range, its high end well above the point.
        let mut small = sim(16, 0, &rule);
        small.peak_reserved = small.peak_allocated * 2;
        let calibration = Calibration {
            points: vec![(16, small), (32, sim(32, 0, &rule))],
            rule,
            gradients_in_backward: false,
            replayed: None,
        };
        let at = |batch: u64| {
            calibration
                .predict(&Scenario {
                    batch,
                    accumulate: 1,
                    rule,
                    begin: 0,
                    zero_ranks: None,
                })
                .unwrap()
        };
        let binding = crate::rewrite::batch::find("let batch_size = 64;").unwrap();
        let limit = 200 * MIB;
        let (_, fixes) = measured_fixes(&calibration, &binding, rule, 0, limit);
        let batch = fixes
            .iter()
            .find(|f| f.line.starts_with("let batch_size"))
            .unwrap();
        let n: u64 = batch.line[17..batch.line.len() - 1].parse().unwrap();
        assert!(batch.covers && batch.why.contains("up to"), "{batch:?}");
        assert!(at(n).peak_reserved_high() <= limit);
        assert!(
            at(n + 1).peak_reserved_high() > limit,
            "{n} is not the largest"
        );
        // The point alone would have said a larger batch fits.
        assert!(at(n + 1).peak_reserved <= limit);
    }

    #[test]
    fn fragmentation_is_named_and_cells_that_do_not_train_get_no_rewrites() {
        let fragmented = OomEvent {
            reserved: Some(15 * GIB),
            allocated: Some(12 * GIB),
            ..event()
        };
        let plain = FailedCell::default();
        let diagnosis = diagnose(&fragmented, &plain);
        assert!(diagnosis.suggestions.is_empty());
        let text = diagnosis.text(&plain);
        assert!(
            text.contains("3.0 GiB was reserved but not allocated"),
            "{text}"
        );
        assert!(text.contains("expandable_segments"));
        assert!(!text.contains("--fit"));
    }
}
