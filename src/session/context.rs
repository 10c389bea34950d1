//! Creating the evcxr context: the child command, the environment, and the prelude that makes
//! tch and the tchmem runtime available in every cell without set-up.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use evcxr::{CommandContext, EvalContext, EvalContextOutputs};

use super::analysis_std::AnalysisStd;
use crate::child::world::RANKS_ENV;
use crate::child::CHILD_ENV;

/// The tch version the runtime crate and cells use (it must match libtorch 2.11).
pub const TCH_VERSION: &str = "0.24.0";

/// The anyhow version every cell may use (`use anyhow::Result;`, as tch's examples do).
pub const ANYHOW_VERSION: &str = "1";

/// Run in every new child process once the prelude is compiled: the runtime's panic hook lives
/// in the child's standard library, so a restarted child needs it again.
pub const CHILD_SETUP: &str = "tchmem::__kernel_session_start();";

/// Run in each rank of a `%%distributed` world after [`CHILD_SETUP`]: it joins the group its
/// launcher described in the environment (see `child::world`).
const JOIN_THE_WORLD: &str = "if let Err(error) = tchmem::dist::Setup::from_env()\
                              .and_then(|setup| tchmem::dist::init(&setup)) {\
                              panic!(\"this rank could not join the world: {error}\"); }";

/// How the engine is set up.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// libtorch to build and run cells against; `None` when it was not found (cells then run
    /// plain Rust, and the first cell says why tch is missing).
    pub libtorch: Option<PathBuf>,
    /// Why libtorch is missing, for the user.
    pub libtorch_problem: Option<String>,
    /// The `tchmem-runtime` crate, added to every cell's dependencies.
    pub runtime_crate: PathBuf,
    /// Why the runtime crate is missing, for the user (cells then run plain Rust, as without
    /// libtorch).
    pub runtime_problem: Option<String>,
    /// Where evcxr compiles cells (see [`super::workdir`]).
    pub workdir: PathBuf,
    /// Load the code analysis at the engine's first idle moment (a kernel, whose users ask for
    /// completions; not a headless run).
    pub warm_up_analysis: bool,
    /// The standard library the code analysis reads: none for evcxr's warm-up, then the
    /// library's crates (set by [`EngineConfig::apply_to_process_environment`]).
    pub analysis_std: Option<AnalysisStd>,
    /// A `%%distributed` world's session: how many ranks run each cell (`None`: the notebook's
    /// own session, one process).
    pub ranks: Option<usize>,
}

impl EngineConfig {
    /// Finds libtorch (see [`crate::libtorch::find`]) and the runtime crate.
    pub fn discover(libtorch: Option<&Path>, workdir: PathBuf) -> EngineConfig {
        let (libtorch, libtorch_problem) = match crate::libtorch::find(libtorch) {
            Ok(found) => (Some(found), None),
            Err(error) => (None, Some(format!("{error:#}"))),
        };
        let (runtime_crate, runtime_problem) = find_runtime_crate();
        EngineConfig {
            libtorch,
            libtorch_problem,
            runtime_problem,
            runtime_crate,
            workdir,
            warm_up_analysis: false,
            analysis_std: None,
            ranks: None,
        }
    }

    /// The configuration of a world of `ranks` processes beside this session, compiling in
    /// `workdir` (see [`super::workdir::prepare_world`]).
    pub fn world(&self, ranks: usize, workdir: PathBuf) -> EngineConfig {
        EngineConfig {
            workdir,
            warm_up_analysis: false,
            analysis_std: None,
            ranks: Some(ranks),
            ..self.clone()
        }
    }

    /// Code that sets up a fresh child process: the runtime's panic hook, and in a world each
    /// rank's place in the process group.
    pub fn child_setup(&self) -> String {
        match self.ranks {
            None => CHILD_SETUP.to_string(),
            Some(_) => format!("{CHILD_SETUP}\n{JOIN_THE_WORLD}"),
        }
    }

    /// Sets the variables that evcxr and cargo (torch-sys' build script) read. Call before
    /// starting threads: the environment is process-wide.
    pub fn apply_to_process_environment(&mut self) {
        std::env::set_var("EVCXR_TMPDIR", &self.workdir);
        // libtorch's own DWARF reader names the file and line of each frame of an allocation's
        // stack (%%memprofile --stacks; cells then have line tables); its default names only
        // functions. A user's choice stays.
        if std::env::var_os("TORCH_SYMBOLIZE_MODE").is_none() {
            std::env::set_var("TORCH_SYMBOLIZE_MODE", "fast");
        }
        if let Some(libtorch) = &self.libtorch {
            std::env::set_var("LIBTORCH", libtorch);
        }
        add_cargo_to_path();
        if self.libtorch.is_some() {
            let root = self.workdir.parent().unwrap_or(&self.workdir);
            self.analysis_std = AnalysisStd::begin(root);
        }
    }

    /// Directories the child's dynamic loader must search: libtorch, Rust's standard library
    /// (cells link it dynamically) and the cells' compiled dependencies. The run paths rustc
    /// writes into cell libraries are relative to `deps/`, and break when cargo copies the
    /// library one level up while the compile directory shares a prefix with the toolchain's
    /// (both under $HOME), so they cannot be relied on.
    fn child_library_path(&self) -> anyhow::Result<String> {
        let sysroot = rustc_output(&["--print", "sysroot"])?;
        let host = rustc_output(&["-vV"])?
            .lines()
            .find_map(|line| line.strip_prefix("host: ").map(str::to_string))
            .context("rustc -vV printed no host")?;
        let mut dirs = vec![
            PathBuf::from(&sysroot)
                .join("lib/rustlib")
                .join(&host)
                .join("lib"),
            self.workdir.join("target").join(&host).join("debug/deps"),
        ];
        if let Some(libtorch) = &self.libtorch {
            dirs.insert(0, libtorch.join("lib"));
        }
        let mut path = std::env::join_paths(&dirs)?
            .into_string()
            .map_err(|_| anyhow::anyhow!("library paths are not UTF-8"))?;
        if let Ok(existing) = std::env::var("LD_LIBRARY_PATH") {
            if !existing.is_empty() {
                path = format!("{path}:{existing}");
            }
        }
        Ok(path)
    }

    /// The `:dep` lines every session starts with: tch, anyhow (tch's examples and most tch
    /// code return its `Result`), the runtime, and the one import every cell gets.
    ///
    /// The runtime comes last on purpose: evcxr checks each `:dep` with `cargo metadata` on a
    /// package of that one dependency, which rewrites the compile slot's Cargo.lock to its
    /// graph. The runtime's graph holds the others' (tch, tchmem-show, and anyhow through
    /// torch-sys), so the lock it leaves is whole, and the code analysis and the build that
    /// follow find nothing to resolve (see `Session::run_prelude`).
    pub fn prelude(&self) -> Option<String> {
        self.libtorch.as_ref()?;
        if self.runtime_problem.is_some() {
            return None;
        }
        Some(format!(
            ":dep tch = \"={TCH_VERSION}\"\n:dep anyhow = \"{ANYHOW_VERSION}\"\n\
             :dep tchmem-show = {{ path = \"{}\" }}\n:dep tchmem-runtime = {{ path = \"{}\" }}\n\
             // Build and load everything now rather than in the user's first cell.\n\
             drop(tch::Tensor::from(0i64));\n\
             // A cell ending in a Debug value compiles once; a crate of its own, so that a\n\
             // cell naming nothing of tch does not load and link the runtime (see tchmem-show).\n\
             use tchmem_show::ShowDebugValue as _;\n\
             {}\n",
            self.show_crate().display(),
            self.runtime_crate.display(),
            self.child_setup()
        ))
    }

    /// The `tchmem-show` crate: beside the runtime crate (in this repository and in an offline
    /// bundle alike), the same path cargo reads from the runtime's own `../show`.
    fn show_crate(&self) -> PathBuf {
        let runtime = std::path::absolute(&self.runtime_crate).unwrap_or_default();
        runtime.parent().unwrap_or(&runtime).join("show")
    }
}

/// `$TCHMEM_RUNTIME_DIR` (unless empty); else `share/tchmem/runtime` beside the binary's `bin/`
/// (an offline bundle, see scripts/offline-pack); else the `runtime/` crate beside this binary's
/// sources. Its sibling crates `wire/` and `show/` sit beside it in each of these. Also says why
/// it will not build, where it will not.
fn find_runtime_crate() -> (PathBuf, Option<String>) {
    if let Some(dir) = std::env::var_os(RUNTIME_DIR_ENV).filter(|dir| !dir.is_empty()) {
        let dir = std::path::absolute(&dir).unwrap_or_else(|_| PathBuf::from(dir));
        let problem = (!is_runtime_crate(&dir)).then(|| {
            format!(
                "{RUNTIME_DIR_ENV} is {}, which holds no tchmem runtime crate: point it at a \
                 runtime/ folder with show/ and wire/ beside it (a checkout's, or an offline \
                 bundle's share/tchmem/runtime), or unset it, in the environment the kernel \
                 starts in (its kernel.json's \"env\"), then restart the kernel",
                dir.display()
            )
        });
        return (dir, problem);
    }
    let bundled = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.canonicalize().ok()?.parent()?.parent()?.join(BUNDLED)));
    if let Some(dir) = bundled.as_ref().filter(|dir| is_runtime_crate(dir)) {
        return (dir.clone(), None);
    }
    let checkout = Path::new(env!("CARGO_MANIFEST_DIR")).join("runtime");
    // A binary built in a checkout that has since moved or gone looks there (the path is
    // compiled in); without this, evcxr's error names another crate's Cargo.toml, then every
    // cell says that `tch` is not found.
    let problem = (!is_runtime_crate(&checkout)).then(|| {
        let beside = bundled.map_or(String::new(), |dir| format!("{} or ", dir.display()));
        format!(
            "tchmem's runtime crate is in neither place this tchmem looks for it: {beside}the \
             checkout it was built in ({}), which has moved or gone. Build tchmem again where its \
             sources are now (scripts/setup), or set {RUNTIME_DIR_ENV} to a runtime/ folder with \
             show/ and wire/ beside it in the environment the kernel starts in (its kernel.json's \
             \"env\"), then restart the kernel",
            checkout.display()
        )
    });
    (checkout, problem)
}

/// The variable that names the runtime crate's folder.
const RUNTIME_DIR_ENV: &str = "TCHMEM_RUNTIME_DIR";

/// Where an offline bundle keeps the runtime crate, from the binary's `bin/`'s parent.
const BUNDLED: &str = "share/tchmem/runtime";

/// Whether `dir` is a runtime crate that builds: its sibling crates, which its manifest names
/// by relative path, beside it.
fn is_runtime_crate(dir: &Path) -> bool {
    let parent = dir.parent().unwrap_or(dir);
    dir.join("Cargo.toml").is_file()
        && ["show", "wire"]
            .iter()
            .all(|sibling| parent.join(sibling).join("Cargo.toml").is_file())
}

/// kineto's switch that detaches CUPTI once a profile has stopped.
const CUPTI_TEARDOWN_ENV: &str = "TEARDOWN_CUPTI";

/// Creates the evcxr context whose child is this binary in child mode.
pub fn create_context(
    config: &EngineConfig,
) -> anyhow::Result<(CommandContext, EvalContextOutputs)> {
    let exe = std::env::current_exe().context("cannot locate the tchmem binary")?;
    let mut child = Command::new(exe);
    child
        .env(CHILD_ENV, "1")
        .env("LD_LIBRARY_PATH", config.child_library_path()?);
    if let Some(ranks) = config.ranks {
        child.env(RANKS_ENV, ranks.to_string());
    }
    // The trials of `%memestimate` profile one step's GPU work (runtime/csrc/busy_time.cpp).
    // Without this, libtorch's profiler (kineto) leaves CUPTI attached after it stops, and every
    // later kernel launch of the session pays for it (measured on the H200: a launch-bound loop
    // 13-26% slower after an estimate, results/gpu/2026-12-05-busy-time). A user's own setting
    // stands.
    if std::env::var_os(CUPTI_TEARDOWN_ENV).is_none() {
        child.env(CUPTI_TEARDOWN_ENV, "1");
    }
    // evcxr reads where to compile from the environment as it creates a context: a world
    // compiles beside the notebook's session, in a folder of its own (the session's folder is
    // put back after, for whatever reads it later).
    let session_dir = std::env::var_os("EVCXR_TMPDIR");
    let moved = session_dir.as_deref() != Some(config.workdir.as_os_str());
    if moved {
        std::env::set_var("EVCXR_TMPDIR", &config.workdir);
    }
    if let Some(std) = &config.analysis_std {
        std.hide_from(&mut child);
    }
    let created = EvalContext::with_subprocess_command(child);
    if let (true, Some(dir)) = (moved, session_dir) {
        std::env::set_var("EVCXR_TMPDIR", dir);
    }
    if let Some(std) = config.analysis_std.clone() {
        std.end();
    }
    let (context, outputs) = created.map_err(|error| {
        anyhow::anyhow!(
            "cannot start the Rust evaluator: {error}\nIt needs cargo and rustc on PATH and the \
             rust-src component (`rustup component add rust-src`)."
        )
    })?;
    Ok((CommandContext::with_eval_context(context), outputs))
}

fn rustc_output(args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("rustc")
        .args(args)
        .output()
        .context("cannot run rustc: is a Rust toolchain on PATH?")?;
    anyhow::ensure!(output.status.success(), "rustc {} failed", args.join(" "));
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// Kernels started from a desktop launcher often lack ~/.cargo/bin on PATH; evcxr needs cargo.
fn add_cargo_to_path() {
    let Some(home) = std::env::var_os("HOME") else {
        return;
    };
    let cargo_bin = Path::new(&home).join(".cargo/bin");
    let path = std::env::var_os("PATH").unwrap_or_default();
    let on_path = std::env::split_paths(&path).any(|dir| dir.join("cargo").is_file());
    if !on_path && cargo_bin.join("cargo").is_file() {
        let dirs = std::iter::once(cargo_bin).chain(std::env::split_paths(&path));
        if let Ok(joined) = std::env::join_paths(dirs) {
            std::env::set_var("PATH", joined);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runtime_crate_builds_only_with_show_and_wire_beside_it() {
        let root = std::env::temp_dir().join(format!("tchmem-runtime-{}", std::process::id()));
        let crate_at = |name: &str| {
            std::fs::create_dir_all(root.join(name)).unwrap();
            std::fs::write(root.join(name).join("Cargo.toml"), "[package]").unwrap();
        };
        let runtime = root.join("runtime");
        assert!(!is_runtime_crate(&runtime), "no folder at all");
        crate_at("runtime");
        assert!(!is_runtime_crate(&runtime), "runtime/ copied alone");
        crate_at("show");
        crate_at("wire");
        assert!(is_runtime_crate(&runtime));
        // This checkout's own, which a test binary finds.
        assert!(is_runtime_crate(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("runtime")
        ));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
