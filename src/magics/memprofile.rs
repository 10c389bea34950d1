//! `%%memprofile`: the cell magic that records libtorch's allocation history around its cell and
//! draws the timeline under it; and the line forms `%memprofile timeline on|off` (every later
//! cell) and `%memsnapshot PATH.pickle` (the last timeline's snapshot, for PyTorch's memory_viz).

use clap::Parser;

use super::MagicReply;

/// The default ring size: PyTorch's examples use 100,000; a training step of a large model makes
/// tens of thousands of entries.
pub const DEFAULT_MAX_ENTRIES: u64 = 1_000_000;

/// Record the CUDA caching allocator's history (every alloc and free) while this cell runs, and
/// draw it under the cell: memory over time by category (parameters, gradients, optimizer state,
/// activations, input batch, other) with the cache above, phases from tchmem::phase markers, the
/// peak and what was alive then. CUDA only.
///
/// Mark the training step (tchmem::phase::train_step, or phase::forward/backward/step/end) so
/// that activations, gradients and optimizer state can be told apart; `%%optimize` can follow on
/// the next line to profile the rewritten loop.
#[derive(Parser, Debug, Clone, PartialEq, Eq)]
#[command(
    name = "%%memprofile",
    no_binary_name = true,
    disable_version_flag = true,
    after_help = "Examples:\n  %%memprofile --steps 2\n  %%memprofile --stacks --snapshot step.pickle\n  \
                  %%memprofile\n  %%optimize --checkpoint"
)]
pub struct MemProfileRequest {
    /// Keep each allocation's C++ stack; frames in the notebook's code are shown as
    /// "cell [N], line L" (costs time per allocation).
    #[arg(long)]
    pub stacks: bool,
    /// The most trace entries kept (a ring: older entries are dropped).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_ENTRIES,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_entries: u64,
    /// Stop recording after N optimizer steps (tchmem::phase::end marks a step's end).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub steps: Option<u32>,
    /// Also write the snapshot (PyTorch's memory_viz pickle) to PATH.
    #[arg(long, value_name = "PATH")]
    pub snapshot: Option<String>,
}

/// Parses `%%memprofile`'s arguments.
pub fn parse_args(args: &[&str]) -> Result<MemProfileRequest, MagicReply> {
    MemProfileRequest::try_parse_from(args).map_err(super::reply)
}

/// Write the snapshot of the last profiled cell (libtorch's allocator snapshot with its trace)
/// to PATH, in the pickle format PyTorch's memory_viz and torch.cuda._memory_viz read.
#[derive(Parser, Debug)]
#[command(
    name = "%memsnapshot",
    no_binary_name = true,
    disable_version_flag = true
)]
pub struct MemSnapshotArgs {
    /// Where to write it (conventionally ending in .pickle).
    pub path: String,
}

/// Parses `%memsnapshot`'s arguments.
pub fn parse_snapshot(args: &[&str]) -> Result<String, MagicReply> {
    MemSnapshotArgs::try_parse_from(args)
        .map(|a| a.path)
        .map_err(super::reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_defaults_and_mistakes() {
        let request = parse_args(&["--stacks", "--steps", "2"]).unwrap();
        assert!(request.stacks);
        assert_eq!(request.steps, Some(2));
        assert_eq!(request.max_entries, DEFAULT_MAX_ENTRIES);
        assert_eq!(parse_args(&[]).unwrap().snapshot, None);
        let Err(MagicReply::Error(zero)) = parse_args(&["--steps", "0"]) else {
            panic!()
        };
        assert!(zero.contains("--steps"), "{zero}");
        let Err(MagicReply::Error(unknown)) = parse_args(&["--stack"]) else {
            panic!()
        };
        assert!(unknown.contains("--stacks"), "{unknown}");
        assert!(
            matches!(parse_args(&["--help"]), Err(MagicReply::Help(h)) if h.contains("--max-entries"))
        );
        assert_eq!(parse_snapshot(&["a.pickle"]).unwrap(), "a.pickle");
        assert!(matches!(parse_snapshot(&[]), Err(MagicReply::Error(_))));
    }
}
