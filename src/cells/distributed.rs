//! `%%distributed` in the cells layer: the world of ranks kept between its cells (a runner of its
//! own, with its own variables), started on the first such cell and again when the number of
//! ranks changes or its processes are gone.

use std::time::Instant;

use super::{auto_watch, fail, Cells, Runner};
use crate::magics::distributed::DistributedRequest;
use crate::magics::CellMagicSource;
use crate::magics::ProfileMode;
use crate::report;
use tchmem_wire::memory::MemoryRecord;

use crate::session::{CellError, CellIo, CellOutcome, CellOutput, ErrorName, StreamName};

/// The ranks of the notebook's `%%distributed` cells, and the runner that reaches them.
pub(super) struct World<R> {
    /// How many ranks it has.
    pub(super) ranks: usize,
    /// Its runner (its variables are the ranks').
    pub(super) runner: R,
    /// Each rank's record after the last cell (what `%memprofile auto` compares with).
    pub(super) last_records: Vec<Option<MemoryRecord>>,
}

impl<R: Runner> Cells<R> {
    /// Runs a `%%distributed` cell's body in every rank of the world (started first when needed).
    pub(super) fn distributed(
        &mut self,
        request: &DistributedRequest,
        source: &CellMagicSource<'_>,
        io: CellIo,
    ) -> CellOutcome {
        let ranks = request.ranks();
        let say = |text: String| (io.output)(CellOutput::Stream(StreamName::Stderr, text));
        if let Some(world) = self.world.take_if(|world| world.ranks != ranks) {
            say(format!(
                "tchmem: the world of {} ranks is stopped (its variables are gone) for one of \
                 {ranks}\n",
                world.ranks
            ));
        }
        if self.world.is_none() {
            let started = Instant::now();
            match self.runner.start_world(ranks) {
                Ok(runner) => {
                    say(format!(
                        "tchmem: {ranks} ranks started in {:.1} s (a process group on Gloo; \
                         variables of %%distributed cells stay in their ranks)\n",
                        started.elapsed().as_secs_f64()
                    ));
                    self.world = Some(World {
                        ranks,
                        runner,
                        last_records: Vec::new(),
                    });
                }
                Err(why) => {
                    return fail(CellError::new(
                        ErrorName::WorldFailed,
                        format!("could not start {ranks} ranks: {why}"),
                    ))
                }
            }
        }
        let Some(world) = self.world.as_mut() else {
            unreachable!("the world was started above");
        };
        // Blank lines for the magic's, so the lines compile errors name are the cell's.
        let code = format!("{}{}", "\n".repeat(source.body_offset), source.body);
        // The stores the body makes are watched in each rank, as in the notebook's cells.
        let (code, _) = auto_watch::watch_where_made(&code);
        // A rank that died takes the world's processes with it; the runner then starts new
        // ones, joined, for the next cell (as it does for the notebook's own child).
        let mut outcome = world.runner.run(&code, io);
        let records = outcome
            .report
            .as_ref()
            .map(|report| report.rank_memory.clone())
            .unwrap_or_default();
        let show = match self.profile_mode {
            ProfileMode::Always => true,
            ProfileMode::Auto => records.iter().enumerate().any(|(rank, record)| {
                let before = world.last_records.get(rank).and_then(Option::as_ref);
                record
                    .as_ref()
                    .is_some_and(|record| report::changed(record, before))
            }),
            ProfileMode::Off => false,
        };
        if show {
            outcome.memory_display = report::distributed::ranks_display(&records);
        }
        world.last_records = records;
        outcome
    }
}
