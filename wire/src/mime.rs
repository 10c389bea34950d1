//! The MIME types of what the kernel shows under a cell beside its HTML and text: the numbers
//! behind each display, for tests, tools and notebooks that read them.

/// A cell's memory record (`MemoryRecord` as JSON).
pub const RECORD_MIME: &str = "application/vnd.tchmem.record+json";
/// Each rank's record after a `%%distributed` cell (a JSON list, by rank; `null` for a rank
/// that sent none).
pub const RANKS_MIME: &str = "application/vnd.tchmem.ranks+json";
/// `%memestimate`'s prediction: terms, totals, the verdict.
pub const ESTIMATE_MIME: &str = "application/vnd.tchmem.estimate+json";
/// A table of trials (`%memfit`, calibrations, `--fit`).
pub const TRIALS_MIME: &str = "application/vnd.tchmem.trials+json";
/// `%%optimize --compare`'s two runs.
pub const COMPARISON_MIME: &str = "application/vnd.tchmem.comparison+json";
/// The live view's last sample of a running cell (`LiveSample` as JSON).
pub const LIVE_MIME: &str = "application/vnd.tchmem.live+json";
