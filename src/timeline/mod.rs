//! Allocation timelines: libtorch's allocation trace of a cell (`%%memprofile`), read from its
//! snapshot pickle, told apart by category with what the runtime captured, downsampled for
//! drawing, and allocation stacks mapped back to notebook cells. Drawing is in
//! `report::timeline`.

pub mod model;
pub mod pickle;
pub mod series;
pub mod sites;
pub mod snapshot;

use tchmem_wire::timeline::TimelineCapture;

pub use model::Timeline;

/// Reads the capture's snapshot and builds its timeline.
pub fn load(capture: &TimelineCapture) -> Result<Timeline, snapshot::SnapshotError> {
    let snapshot = snapshot::read(&capture.snapshot)?;
    Ok(model::build(snapshot, capture))
}
