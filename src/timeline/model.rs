//! From the allocator's trace to a timeline by category: every block's category (what the
//! runtime knew about it), the memory in each category after every event, and what was alive at
//! the peak.
//!
//! A block's category comes from, in order: the watched tensors' storages (parameters,
//! gradients, input batch) when the block still held one at the end; else the phase it was
//! allocated in and whether it outlived that phase: made in a forward pass and alive when it
//! ended → activations; in backward and alive after it → gradients; in an optimizer step and
//! kept → optimizer state; while making the batch and kept → input batch. Everything else,
//! temporaries included, is "other tensors". Blocks allocated before recording began count as
//! the capture's start categories say.
//!
//! Phases are told by time: the `tchmem::phase` marks against each entry's time (both in µs
//! since the epoch). The allocator also stamps the phase on each entry as its user metadata,
//! but only for the thread that set it, and autograd runs backward on threads of its own (on
//! the H200 the backward pass's gradients came with no stamp), so the stamps are for PyTorch's
//! viewer, not for this.

use std::collections::HashMap;

use tchmem_wire::memory::CategoryName;
use tchmem_wire::timeline::{Phase, Storage, TimelineCapture};

use super::snapshot::{Snapshot, TraceEntry};

/// The categories a timeline stacks (allocated memory; the cache goes on top).
/// The categories a timeline stacks (allocated memory; the cache goes on top), the steadiest at
/// the bottom.
pub const STACKED: [CategoryName; 7] = [
    CategoryName::CudaContext,
    CategoryName::Parameters,
    CategoryName::OptimizerState,
    CategoryName::Gradients,
    CategoryName::InputBatch,
    CategoryName::Other,
    CategoryName::Activations,
];

fn slot(category: CategoryName) -> usize {
    let other = STACKED.iter().position(|&c| c == CategoryName::Other);
    STACKED
        .iter()
        .position(|&c| c == category)
        .or(other)
        .unwrap_or_default()
}

/// One allocated block seen in the trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    /// Its address.
    pub address: u64,
    /// Its bytes.
    pub size: u64,
    /// Index of its `alloc` entry in the trace (`None`: allocated before recording began).
    pub alloc_entry: Option<usize>,
    /// Index of its `free_completed` entry (`None`: alive at the end).
    pub free_entry: Option<usize>,
    /// The phase it was allocated in.
    pub phase: Phase,
    /// Which span of phases (an index into the capture's marks, `None` before the first) it was
    /// allocated in, and freed in.
    pub spans: (Option<usize>, Option<Option<usize>>),
    /// What it held.
    pub category: CategoryName,
}

/// A change of the stacked memory: after trace entry `entry`, `bytes` more (or fewer) in
/// `category` and `reserved` more (or fewer) reserved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Change {
    /// Microseconds since the epoch.
    pub time_us: i64,
    /// The trace entry.
    pub entry: usize,
    /// Index into [`STACKED`].
    pub slot: u8,
    /// Allocated bytes added (negative: freed).
    pub bytes: i64,
    /// Reserved bytes added (segments).
    pub reserved: i64,
    /// The block allocated or freed (an index into the timeline's blocks), if one was.
    pub block: Option<usize>,
}

/// An allocation that failed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OomMark {
    /// When.
    pub time_us: i64,
    /// The request's bytes.
    pub requested: u64,
    /// The device's free bytes then.
    pub device_free: u64,
}

/// A span of time in one phase.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PhaseBand {
    /// The phase.
    pub phase: Phase,
    /// Start (µs since the epoch).
    pub start_us: i64,
    /// End.
    pub end_us: i64,
}

/// The memory at one instant, per stacked category, and the reserved bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct State {
    /// Bytes in each of [`STACKED`].
    pub bytes: [u64; STACKED.len()],
    /// Reserved bytes (allocated + cache).
    pub reserved: u64,
}

impl State {
    /// Allocated bytes (the categories' sum).
    pub fn allocated(&self) -> u64 {
        self.bytes.iter().sum()
    }
}

/// A cell's allocation timeline.
#[derive(Debug, Clone)]
pub struct Timeline {
    /// The trace, as recorded.
    pub entries: Vec<TraceEntry>,
    /// Every block the trace allocated or freed.
    pub blocks: Vec<Block>,
    /// Memory when recording began.
    pub start: State,
    /// Every change, in trace order.
    pub changes: Vec<Change>,
    /// Failed allocations.
    pub ooms: Vec<OomMark>,
    /// Phases over time.
    pub phases: Vec<PhaseBand>,
    /// Recording's first and last instant.
    pub start_us: i64,
    /// The last instant.
    pub end_us: i64,
    /// The peak: the instant of most allocated memory.
    pub peak: Peak,
    /// Whether the ring was full (earlier entries were dropped).
    pub truncated: bool,
    /// Allocations and frees counted in the trace.
    pub allocs: usize,
    /// Frees counted.
    pub frees: usize,
}

/// The instant of most allocated memory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Peak {
    /// When.
    pub time_us: i64,
    /// Index of the change after which the peak holds (`None`: at the start).
    pub change: Option<usize>,
    /// Memory then.
    pub state: State,
    /// Blocks alive then, largest first (indices into `blocks`).
    pub alive: Vec<usize>,
}

/// The category of a block that was alive when recording began.
fn start_category(address: u64, storages: &[Storage]) -> CategoryName {
    storages
        .iter()
        .find(|s| s.address == address)
        .map_or(CategoryName::Other, |s| s.category)
}

/// The category of a block allocated while recording (see the module's doc).
fn classify(block: &Block, at_end: &HashMap<u64, CategoryName>) -> CategoryName {
    if block.free_entry.is_none() {
        if let Some(&category) = at_end.get(&block.address) {
            return category;
        }
    }
    // Freed in a later span of phases than the one it was made in, or never.
    let outlived = match block.spans {
        (_, None) => true,
        (made, Some(freed)) => freed > made,
    };
    match block.phase {
        Phase::Forward if outlived => CategoryName::Activations,
        Phase::Backward if outlived => CategoryName::Gradients,
        Phase::Step if outlived => CategoryName::OptimizerState,
        Phase::Data if outlived => CategoryName::InputBatch,
        _ => CategoryName::Other,
    }
}

/// The phases as bands over [start, end].
fn bands(capture: &TimelineCapture, end_us: i64) -> Vec<PhaseBand> {
    let mut bands: Vec<PhaseBand> = Vec::new();
    for (i, mark) in capture.phases.iter().enumerate() {
        let next = capture
            .phases
            .get(i + 1)
            .map_or(end_us, |m| m.time_us)
            .min(end_us);
        match bands.last_mut() {
            Some(last) if last.phase == mark.phase => last.end_us = next,
            _ => bands.push(PhaseBand {
                phase: mark.phase,
                start_us: mark.time_us,
                end_us: next,
            }),
        }
    }
    bands.retain(|b| b.phase != Phase::Other && b.end_us > b.start_us);
    bands
}

/// Builds the timeline of `snapshot`'s device-0 trace with what `capture` knew.
pub fn build(snapshot: Snapshot, capture: &TimelineCapture) -> Timeline {
    let entries = snapshot
        .device_traces
        .into_iter()
        .find(|trace| !trace.is_empty())
        .unwrap_or_default();
    let truncated = capture.max_entries > 0 && entries.len() as u64 >= capture.max_entries;
    let Traced {
        blocks,
        ooms,
        allocs,
        frees,
    } = blocks_of(&entries, capture);
    let start = start_state(capture);
    let (changes, mut peak) = changes_of(&entries, &blocks, start, capture.started_us);
    peak.alive = alive_at(&blocks, peak.change.map(|c| changes[c].entry));
    let first = entries.first().map_or(capture.started_us, |e| e.time_us);
    let last = entries.last().map_or(capture.ended_us, |e| e.time_us);
    let start_us = if capture.started_us > 0 {
        capture.started_us.min(first)
    } else {
        first
    };
    let end_us = capture.ended_us.max(last).max(start_us + 1);
    Timeline {
        phases: bands(capture, end_us),
        entries,
        blocks,
        start,
        changes,
        ooms,
        start_us,
        end_us,
        peak,
        truncated,
        allocs,
        frees,
    }
}

/// The blocks of a trace (each allocation, and frees of blocks made before recording), its OOMs
/// and its counts.
struct Traced {
    blocks: Vec<Block>,
    ooms: Vec<OomMark>,
    allocs: usize,
    frees: usize,
}

/// Reads the trace's allocations and frees into blocks, each classified by the watched
/// storages and the phase span it was made in and outlived.
fn blocks_of(entries: &[TraceEntry], capture: &TimelineCapture) -> Traced {
    let mut blocks: Vec<Block> = Vec::new();
    let mut live: HashMap<u64, usize> = HashMap::new();
    let mut ooms = Vec::new();
    let (mut allocs, mut frees) = (0, 0);
    let marks = &capture.phases;
    let span_of = |time: i64| marks.partition_point(|m| m.time_us <= time).checked_sub(1);
    let phase_of = |span: Option<usize>| span.map_or(Phase::Other, |s| marks[s].phase);
    for (index, entry) in entries.iter().enumerate() {
        let span = span_of(entry.time_us);
        match entry.action.as_str() {
            "alloc" => {
                allocs += 1;
                live.insert(entry.addr, blocks.len());
                blocks.push(Block {
                    address: entry.addr,
                    size: entry.size,
                    alloc_entry: Some(index),
                    free_entry: None,
                    phase: phase_of(span),
                    spans: (span, None),
                    category: CategoryName::Other,
                });
            }
            "free_completed" => {
                frees += 1;
                match live.remove(&entry.addr) {
                    Some(b) => {
                        blocks[b].free_entry = Some(index);
                        blocks[b].spans.1 = Some(span);
                    }
                    None => blocks.push(Block {
                        address: entry.addr,
                        size: entry.size,
                        alloc_entry: None,
                        free_entry: Some(index),
                        phase: Phase::Other,
                        spans: (None, Some(span)),
                        category: start_category(entry.addr, &capture.storages_at_start),
                    }),
                }
            }
            "oom" => ooms.push(OomMark {
                time_us: entry.time_us,
                requested: entry.size,
                device_free: entry.addr,
            }),
            _ => {}
        }
    }
    let at_end: HashMap<u64, CategoryName> = capture
        .storages_at_end
        .iter()
        .map(|s| (s.address, s.category))
        .collect();
    for block in blocks.iter_mut().filter(|b| b.alloc_entry.is_some()) {
        block.category = classify(block, &at_end);
    }

    Traced {
        blocks,
        ooms,
        allocs,
        frees,
    }
}

/// The state when recording began: the capture's categories, which add up to the allocated
/// bytes.
fn start_state(capture: &TimelineCapture) -> State {
    let mut start = State {
        reserved: capture.at_start.reserved,
        ..Default::default()
    };
    for category in &capture.start_categories {
        start.bytes[slot(category.name)] += category.bytes;
    }
    let counted = start.allocated();
    if counted < capture.at_start.allocated {
        start.bytes[slot(CategoryName::Other)] += capture.at_start.allocated - counted;
    }

    start
}

/// The changes of category bytes and reserved bytes in trace order, and the peak of allocated
/// bytes among them (its alive blocks not yet listed).
fn changes_of(
    entries: &[TraceEntry],
    blocks: &[Block],
    start: State,
    started_us: i64,
) -> (Vec<Change>, Peak) {
    let mut by_entry: Vec<(usize, usize, bool)> = Vec::with_capacity(entries.len());
    for (b, block) in blocks.iter().enumerate() {
        if let Some(e) = block.alloc_entry {
            by_entry.push((e, b, true));
        }
        if let Some(e) = block.free_entry {
            by_entry.push((e, b, false));
        }
    }
    by_entry.sort_unstable_by_key(|&(e, _, _)| e);
    let mut changes = Vec::with_capacity(by_entry.len());
    let mut pending = by_entry.into_iter().peekable();
    let mut state = start;
    let mut peak = Peak {
        time_us: started_us,
        change: None,
        state: start,
        alive: Vec::new(),
    };
    for (index, entry) in entries.iter().enumerate() {
        let reserved = match entry.action.as_str() {
            "segment_alloc" | "segment_map" => entry.size as i64,
            "segment_free" | "segment_unmap" => -(entry.size as i64),
            _ => 0,
        };
        let mut change = None;
        while let Some(&(e, b, is_alloc)) = pending.peek() {
            if e != index {
                break;
            }
            pending.next();
            let block = &blocks[b];
            let mut slot = slot(block.category);
            let bytes = if is_alloc {
                block.size as i64
            } else {
                // A block from before recording leaves its start category; what that category
                // no longer holds comes out of "other tensors" (rounding of watched sizes).
                if block.alloc_entry.is_none() && state.bytes[slot] < block.size {
                    slot = self::slot(CategoryName::Other);
                }
                -(block.size as i64)
            };
            change = Some(Change {
                time_us: entry.time_us,
                entry: index,
                slot: slot as u8,
                bytes,
                reserved: 0,
                block: Some(b),
            });
        }
        if reserved != 0 && change.is_none() {
            change = Some(Change {
                time_us: entry.time_us,
                entry: index,
                slot: 0,
                bytes: 0,
                reserved,
                block: None,
            });
        }
        if let Some(change) = change {
            apply(&mut state, &change);
            changes.push(change);
            if state.allocated() > peak.state.allocated() {
                peak.state = state;
                peak.time_us = change.time_us;
                peak.change = Some(changes.len() - 1);
            }
        }
    }
    (changes, peak)
}

/// The blocks alive at trace entry `at` (none without a peak), largest first.
fn alive_at(blocks: &[Block], at: Option<usize>) -> Vec<usize> {
    let mut alive: Vec<usize> = blocks
        .iter()
        .enumerate()
        .filter(|(_, b)| {
            let Some(at) = at else { return false };
            b.alloc_entry.is_some_and(|e| e <= at) && b.free_entry.is_none_or(|e| e > at)
        })
        .map(|(i, _)| i)
        .collect();
    alive.sort_by_key(|&i| std::cmp::Reverse(blocks[i].size));

    alive
}

/// Applies one change to a state.
pub fn apply(state: &mut State, change: &Change) {
    let slot = change.slot as usize;
    state.bytes[slot] = state.bytes[slot].saturating_add_signed(change.bytes);
    state.reserved = state.reserved.saturating_add_signed(change.reserved);
}

impl Timeline {
    /// The state after every change, replayed (for tests and the downsampler).
    pub fn states(&self) -> impl Iterator<Item = (i64, State)> + '_ {
        let mut state = self.start;
        self.changes.iter().map(move |change| {
            apply(&mut state, change);
            (change.time_us, state)
        })
    }

    #[cfg(test)]
    /// Allocated bytes after every change, from the trace's entries alone (the start's
    /// allocated bytes plus every `alloc` minus every `free_completed`), independently of the
    /// blocks and categories, to check them against.
    pub fn allocated_from_trace(&self) -> Vec<u64> {
        let mut allocated = self.start.allocated() as i64;
        let mut changes = self.changes.iter().peekable();
        let mut out = Vec::with_capacity(self.changes.len());
        for (index, entry) in self.entries.iter().enumerate() {
            match entry.action.as_str() {
                "alloc" => allocated += entry.size as i64,
                "free_completed" => allocated -= entry.size as i64,
                _ => {}
            }
            while changes.peek().is_some_and(|c| c.entry == index) {
                changes.next();
                out.push(allocated.max(0) as u64);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::snapshot;

    /// A capture recorded on the H200 (`timeline_bench fixture`), with its pickle beside it.
    fn fixture(name: &str) -> Timeline {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/timeline");
        let text = std::fs::read_to_string(format!("{dir}/{name}.json")).unwrap();
        let capture: TimelineCapture = serde_json::from_str(&text).unwrap();
        let snapshot = snapshot::read(&format!("{dir}/{name}.pickle")).unwrap();
        build(snapshot, &capture)
    }

    #[test]
    fn categories_add_up_to_the_allocated_bytes_of_the_trace_at_every_instant() {
        for name in ["trace", "stacks"] {
            let timeline = fixture(name);
            let from_trace = timeline.allocated_from_trace();
            assert_eq!(from_trace.len(), timeline.changes.len());
            assert!(
                timeline.changes.len() > 300,
                "{name}: {}",
                timeline.changes.len()
            );
            for ((_, state), allocated) in timeline.states().zip(from_trace) {
                assert_eq!(state.allocated(), allocated, "{name}");
            }
        }
    }

    #[test]
    fn a_training_step_shows_each_category_where_it_belongs() {
        // Two AdamW steps of a 77M-parameter GPT: gradients and Adam's two moments are exactly
        // one and two times the parameters at the peak (in the second step's forward pass).
        let timeline = fixture("trace");
        let bytes = |c| timeline.peak.state.bytes[slot(c)];
        let parameters = bytes(CategoryName::Parameters);
        assert!(parameters > 300_000_000, "{parameters}");
        assert_eq!(bytes(CategoryName::Gradients), parameters);
        assert_eq!(bytes(CategoryName::OptimizerState), 2 * parameters);
        assert!(bytes(CategoryName::Activations) > 100 << 20);
        assert!(bytes(CategoryName::InputBatch) > 0);
        let peak_phase = timeline
            .phases
            .iter()
            .find(|b| b.start_us <= timeline.peak.time_us && timeline.peak.time_us < b.end_us)
            .map(|b| b.phase);
        assert_eq!(peak_phase, Some(Phase::Forward));
        assert_eq!(timeline.allocs, 419);
        assert!(timeline.ooms.is_empty() && !timeline.truncated);
    }
}
