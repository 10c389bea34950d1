//! What the cells layer needs from whatever runs code: the seam between what a cell means and
//! how Rust gets compiled and run. The evcxr [`Session`](super::Session) implements it; the
//! cells layer's tests use a fake that answers from a script, so the orchestration is tested
//! without a compiler. It lives here, under the cells layer, so that nothing imports upwards.

use super::{CellIo, CellOutcome};

/// Runs code for the cells layer, one piece at a time.
pub trait Runner {
    /// Compiles and runs `code` (Rust, and evcxr's `:` commands); output goes to `io` as it
    /// comes. The outcome carries the child's report of the run, when the code ran.
    fn run(&mut self, code: &str, io: CellIo) -> CellOutcome;

    /// Whether tchmem's runtime is loaded where cells run (watching, recording, trials need it).
    fn has_runtime(&self) -> bool;

    /// The `src/` folder of the cells' dependency `krate` (`tch`), where its sources are at
    /// hand: `--checkpoint` reads a library's model there.
    fn dependency_source(&self, krate: &str) -> Option<std::path::PathBuf>;

    /// Changes whenever a new process replaced the one running cells (its variables are gone).
    fn process_generation(&self) -> u64;

    /// The session's variables and their types, as the compiler names them.
    fn variables(&self) -> Vec<(String, String)>;

    /// Takes the evcxr commands answered without compiling (`:opt`) off `code`: the rest of the
    /// code, and each command's answer or mistake.
    fn take_commands(&mut self, code: &str) -> (String, Vec<Result<String, String>>);

    /// Builds the next cells with line tables (so stack frames name cell lines) or without.
    fn set_line_tables(&mut self, on: bool);

    /// The source of the crate the last cell was compiled in, by line (stack frames point there).
    fn generated_source(&self) -> Vec<String>;

    /// Starts a runner for a `%%distributed` world of `ranks` processes beside this one: each of
    /// its cells runs in every rank, with variables of its own. `Err`: why it could not start.
    fn start_world(&mut self, ranks: usize) -> Result<Self, String>
    where
        Self: Sized;
}
