//! evcxr's warm-up analysed without the standard library.
//!
//! evcxr runs rust-analyzer on every cell, to tell the types of the variables the cell defines,
//! and once while it creates its context (on `42`, before any dependency is declared). The first
//! analysis of a crate graph reads the standard library's sources: 3 s on two cores. The prelude
//! declares tch and the runtime, which makes a new crate graph that is read again, so the
//! warm-up's 3 s bought nothing (measured with perf, 2026-12-02: 3.9 s of a 10.5 s start were
//! evcxr's context). During the warm-up rust-analyzer is shown an empty standard library
//! (`RUST_SRC_PATH`, which it reads when it loads a crate graph); the variable is gone before the
//! prelude, whose crate graph then has the real one.

use std::path::Path;

/// What rust-analyzer reads the standard library's location from.
const SOURCE_VARIABLE: &str = "RUST_SRC_PATH";
/// The empty library, under the compile slots' root.
const EMPTY_LIBRARY: &str = "analysis-without-std";

/// The empty library is in force until [`DeferredStd::end`].
#[derive(Debug, Clone, Copy)]
pub struct DeferredStd;

impl DeferredStd {
    /// Points rust-analyzer at an empty standard library under `root`, unless the user set
    /// `RUST_SRC_PATH` (then nothing changes). Call before starting threads: the environment is
    /// process-wide.
    pub fn begin(root: &Path) -> Option<DeferredStd> {
        if std::env::var_os(SOURCE_VARIABLE).is_some() {
            return None;
        }
        let library = root.join(EMPTY_LIBRARY);
        // One empty crate: rust-analyzer then has nothing to read.
        let core = library.join("core").join("src");
        let made = std::fs::create_dir_all(&core).and_then(|()| {
            std::fs::write(
                core.join("lib.rs"),
                "// tchmem: see src/session/deferred_std.rs\n",
            )
        });
        if let Err(error) = made {
            tracing::debug!("evcxr's warm-up reads the standard library: {error}");
            return None;
        }
        std::env::set_var(SOURCE_VARIABLE, &library);
        Some(DeferredStd)
    }

    /// Removes the variable once evcxr's context exists. (Other threads read the environment
    /// only through Rust's own lock: the kernel process runs no C code that reads it.)
    pub fn end(self) {
        std::env::remove_var(SOURCE_VARIABLE);
    }

    /// Keeps the variable from a process started while it is set (the child that runs cells).
    pub fn hide_from(&self, command: &mut std::process::Command) {
        command.env_remove(SOURCE_VARIABLE);
    }
}
