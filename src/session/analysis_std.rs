//! The standard library that evcxr's code analysis reads.
//!
//! evcxr runs rust-analyzer on every cell (to tell the types of the variables it defines), and
//! once while it creates its context (on `42`, before any dependency is declared). rust-analyzer
//! finds the standard library through `RUST_SRC_PATH` (else the toolchain's `rust-src`), each
//! time it loads a crate graph. Two choices here make a start faster (measured with
//! `scripts/bench/startup`, see results/startup-cpu.txt):
//!
//! - The warm-up's crate graph is thrown away by the prelude's (which adds tch and the runtime),
//!   so reading the library for it bought nothing: it is shown an empty library.
//! - Given the toolchain's `library/`, rust-analyzer reads it as a cargo workspace: core, alloc
//!   and std with all of their own dependencies (hashbrown, libc, gimli, object,
//!   compiler_builtins, …) and their macros, and runs `cargo metadata` on it. What a cell names
//!   lives in core, alloc and std themselves. Shown the library's crates without the workspace's
//!   manifest, rust-analyzer takes its own fixed list of the library's crates instead. A cell's
//!   types and completions are the same (the dependencies are private to std).
//! - core takes in `core::arch` by path from the library's `stdarch/`: the SIMD intrinsics of
//!   every architecture, 8 MB of source for x86-64 alone, more than the rest of core. The
//!   library's `stdarch` links to a folder holding an empty module instead: core's part of the
//!   first analysis took 2.00-2.18 s with them, 1.21-1.29 s without (results/startup-cpu.txt).
//!   A cell that keeps an intrinsic's value in a variable of unwritten type then has its type
//!   told by the compiler (`typed_by_compiler`, and the import rustc suggests), and completion
//!   does not list `std::arch`; cells compile against the real library as before. (In a
//!   toolchain whose `std_detect` still lives in `stdarch/`, the analysis does not see that
//!   either.)

use std::path::{Path, PathBuf};
use std::process::Command;

/// What rust-analyzer reads the standard library's location from.
const SOURCE_VARIABLE: &str = "RUST_SRC_PATH";
/// The empty library, under the compile slots' root.
const EMPTY_LIBRARY: &str = "analysis-without-std";
/// The library's crates without its workspace manifest, under the compile slots' root.
const CRATES_ONLY_LIBRARY: &str = "analysis-std";
/// The files of the toolchain's `library/` that make it a cargo workspace.
const WORKSPACE_FILES: [&str; 2] = ["Cargo.toml", "Cargo.lock"];
/// The library's folder that core takes `core::arch` from, and the module it names there.
const ARCH_FOLDER: &str = "stdarch";
const ARCH_MODULE: &str = "crates/core_arch/src/mod.rs";
/// The folder, under the compile slots' root, that the library's `stdarch` links to instead.
const ARCH_STUB_FOLDER: &str = "analysis-arch-stub";
/// What the analysis reads as that module: the one name core re-exports from it.
const ARCH_STUB: &str = "// tchmem: see src/session/analysis_std.rs\npub mod arch {}\n";

/// Which library rust-analyzer is shown: the empty one until [`AnalysisStd::end`], then the
/// library's crates (or, where they could not be linked, the toolchain's own library).
#[derive(Debug, Clone)]
pub struct AnalysisStd {
    crates_only: Option<PathBuf>,
}

impl AnalysisStd {
    /// Points rust-analyzer at an empty standard library under `root`, and links the toolchain
    /// library's crates there for later, unless the user set `RUST_SRC_PATH` (then nothing
    /// changes). Call before starting threads: the environment is process-wide.
    pub fn begin(root: &Path) -> Option<AnalysisStd> {
        if std::env::var_os(SOURCE_VARIABLE).is_some() {
            return None;
        }
        let library = root.join(EMPTY_LIBRARY);
        // One empty crate: rust-analyzer then has nothing to read.
        let core = library.join("core").join("src");
        let made = std::fs::create_dir_all(&core).and_then(|()| {
            std::fs::write(
                core.join("lib.rs"),
                "// tchmem: see src/session/analysis_std.rs\n",
            )
        });
        if let Err(error) = made {
            tracing::debug!("evcxr's warm-up reads the standard library: {error}");
            return None;
        }
        let crates_only = toolchain_library(root).and_then(|toolchain| {
            // One folder per toolchain: kernels on different toolchains may share the root.
            let linked = root.join(CRATES_ONLY_LIBRARY).join(folder_name(&toolchain));
            let arch_stub = root.join(ARCH_STUB_FOLDER);
            write_arch_stub(&arch_stub)
                .and_then(|()| link_crates(&toolchain, &linked, &arch_stub))
                .map_err(|error| {
                    tracing::warn!(
                        "the code analysis reads the standard library's workspace (slower): \
                         cannot link its crates into {}: {error}",
                        linked.display()
                    );
                })
                .ok()
                .map(|()| linked)
        });
        std::env::set_var(SOURCE_VARIABLE, &library);
        Some(AnalysisStd { crates_only })
    }

    /// Once evcxr's context exists: the library's crates from now on, or the toolchain's
    /// library where they could not be linked. (Other threads read the environment only
    /// through Rust's own lock: the kernel process runs no C code that reads it.)
    pub fn end(self) {
        match &self.crates_only {
            Some(library) => std::env::set_var(SOURCE_VARIABLE, library),
            None => std::env::remove_var(SOURCE_VARIABLE),
        }
    }

    /// Keeps the variable from a process started while it is set (the child that runs cells).
    pub fn hide_from(&self, command: &mut Command) {
        command.env_remove(SOURCE_VARIABLE);
    }
}

/// The toolchain's `library/` (the `rust-src` component), if installed: as rust-analyzer finds
/// it, asking `rustc` in the compile slots' folder (a `rust-toolchain.toml` above it counts).
fn toolchain_library(root: &Path) -> Option<PathBuf> {
    let output = Command::new("rustc")
        .args(["--print", "sysroot"])
        .current_dir(root)
        .output()
        .ok()
        .filter(|output| output.status.success())?;
    let sysroot = String::from_utf8(output.stdout).ok()?;
    let library = Path::new(sysroot.trim()).join("lib/rustlib/src/rust/library");
    library.join("std").is_dir().then_some(library)
}

/// A folder name that tells toolchains apart (a hash of the library's path).
fn folder_name(toolchain: &Path) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    toolchain.hash(&mut hasher);
    format!("{:016x}", hasher.finish())
}

/// Links every entry of `toolchain` but its workspace files into `linked` (`stdarch` to
/// `arch_stub`), and removes links to entries the toolchain no longer has. Kernels sharing the
/// compile root may do this at once: a link already right is kept, a wrong one replaced by a
/// rename (never removed first), so a reader never finds a crate missing.
fn link_crates(toolchain: &Path, linked: &Path, arch_stub: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(linked)?;
    let mut names = Vec::new();
    for entry in std::fs::read_dir(toolchain)? {
        let name = entry?.file_name();
        if WORKSPACE_FILES.iter().any(|file| name == *file) {
            continue;
        }
        let target = match name == ARCH_FOLDER {
            true => arch_stub.to_path_buf(),
            false => toolchain.join(&name),
        };
        let link = linked.join(&name);
        names.push(name);
        if std::fs::read_link(&link).is_ok_and(|current| current == target) {
            continue;
        }
        let fresh = linked.join(format!(
            ".{}.{}",
            link.file_name().unwrap_or_default().to_string_lossy(),
            std::process::id()
        ));
        let _ = std::fs::remove_file(&fresh);
        std::os::unix::fs::symlink(&target, &fresh)?;
        if let Err(error) = std::fs::rename(&fresh, &link) {
            let _ = std::fs::remove_file(&fresh);
            return Err(error);
        }
    }
    for entry in std::fs::read_dir(linked)? {
        let name = entry?.file_name();
        // Dot names are other kernels' links on their way in.
        if !name.to_string_lossy().starts_with('.') && !names.contains(&name) {
            let _ = std::fs::remove_file(linked.join(&name));
        }
    }
    Ok(())
}

/// Writes the empty `core::arch` module under `folder` (this process's file renamed into place,
/// for kernels sharing the root), unless it is there already.
fn write_arch_stub(folder: &Path) -> std::io::Result<()> {
    let module = folder.join(ARCH_MODULE);
    if std::fs::read_to_string(&module).is_ok_and(|text| text == ARCH_STUB) {
        return Ok(());
    }
    std::fs::create_dir_all(module.parent().unwrap_or(folder))?;
    let fresh = module.with_extension(format!("rs.{}", std::process::id()));
    std::fs::write(&fresh, ARCH_STUB)?;
    std::fs::rename(&fresh, &module)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_is_linked_without_its_workspace_and_relinked_when_it_moves() {
        let dir = std::env::temp_dir().join(format!("tchmem-analysis-std-{}", std::process::id()));
        let (old, new, linked) = (dir.join("old"), dir.join("new"), dir.join("linked"));
        for toolchain in [&old, &new] {
            std::fs::create_dir_all(toolchain.join("std/src")).unwrap();
            std::fs::create_dir_all(toolchain.join("core/src")).unwrap();
            std::fs::write(toolchain.join("Cargo.toml"), "[workspace]\n").unwrap();
            std::fs::write(toolchain.join("Cargo.lock"), "").unwrap();
        }
        // A folder only the old toolchain has: core's `core::arch`, linked to the empty
        // module (over the link to the toolchain's that a kernel of an earlier version made).
        std::fs::create_dir_all(old.join("stdarch/crates/core_arch/src")).unwrap();
        std::fs::create_dir_all(&linked).unwrap();
        std::os::unix::fs::symlink(old.join("stdarch"), linked.join("stdarch")).unwrap();
        let stub = dir.join("stub");
        write_arch_stub(&stub).unwrap();
        write_arch_stub(&stub).unwrap();
        link_crates(&old, &linked, &stub).unwrap();
        assert_eq!(
            std::fs::read_link(linked.join("std")).unwrap(),
            old.join("std")
        );
        assert_eq!(std::fs::read_link(linked.join("stdarch")).unwrap(), stub);
        assert_eq!(
            std::fs::read_to_string(linked.join("stdarch").join(ARCH_MODULE)).unwrap(),
            ARCH_STUB
        );
        assert!(!old.join("stdarch").join(ARCH_MODULE).exists());
        let stub_files: Vec<_> = std::fs::read_dir(stub.join("crates/core_arch/src"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(stub_files, ["mod.rs"]);
        assert!(!linked.join("Cargo.toml").exists() && !linked.join("Cargo.lock").exists());
        // A new toolchain in the same place: the links follow it, and nothing else is left.
        link_crates(&new, &linked, &stub).unwrap();
        assert_eq!(
            std::fs::read_link(linked.join("core")).unwrap(),
            new.join("core")
        );
        let mut names: Vec<_> = std::fs::read_dir(&linked)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["core", "std"]);
        assert_ne!(folder_name(&old), folder_name(&new));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
