//! The directory where evcxr compiles cells, kept between kernel runs.
//!
//! Compiling torch-sys for the cells takes minutes; evcxr keeps its build in `EVCXR_TMPDIR`, so a
//! kernel that reuses the previous kernel's directory starts in seconds. Two live kernels must
//! not share one, so each takes the first free numbered slot and holds an exclusive lock on it
//! for as long as it lives (the lock goes with the process, also when it is killed). A slot
//! that has never built anything (a second notebook open beside the first) starts from a copy of
//! another slot's build of the dependencies, so it too starts in seconds.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::Context;

/// Slots tried before giving up: more kernels than this at once on one machine is unusual.
const MAX_SLOTS: usize = 32;

/// A compile directory owned by this process until dropped.
pub struct Workdir {
    /// The directory to give evcxr.
    pub path: PathBuf,
    _lock: File,
}

/// Takes the first free slot under `root` (created if missing).
pub fn acquire(root: PathBuf) -> anyhow::Result<Workdir> {
    std::fs::create_dir_all(&root)
        .with_context(|| format!("cannot create the compile directory {}", root.display()))?;
    for slot in 0..MAX_SLOTS {
        let lock_path = root.join(format!("slot-{slot}.lock"));
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .with_context(|| format!("cannot open {}", lock_path.display()))?;
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            let path = root.join(format!("slot-{slot}"));
            std::fs::create_dir_all(&path)?;
            if !path.join("target").exists() {
                if let Some(built) = built_slot(&root, &path) {
                    // A failed copy only costs the build it would have saved.
                    if let Err(error) = seed(&built, &path) {
                        tracing::warn!("{error:#}");
                    }
                }
            }
            return Ok(Workdir { path, _lock: lock });
        }
    }
    anyhow::bail!(
        "all {MAX_SLOTS} compile directories under {} are in use by running kernels; \
         stop one, or set TCHMEM_WORKDIR to another directory",
        root.display()
    )
}

/// The folder a `%%distributed` world compiles in: beside `main` (`slot-N-world` beside
/// `slot-N`), so the same lock owns it. A new one (or one whose dependencies are not the
/// session's any more) starts from a copy of `main`'s build of the dependencies (see [`seed`]):
/// tch's native part alone takes minutes to build, and the world's cells use the same crates.
pub fn prepare_world(main: &Path) -> anyhow::Result<PathBuf> {
    let name = main
        .file_name()
        .with_context(|| format!("{} has no folder name", main.display()))?;
    let mut world_name = name.to_os_string();
    world_name.push("-world");
    let world = main.with_file_name(world_name);
    let target = world.join("target");
    if target.exists() && builds_what(&world, main) {
        return Ok(world);
    }
    // A world folder left by another build of tchmem (its crates elsewhere) would rebuild tch.
    let _ = std::fs::remove_dir_all(&target);
    seed(main, &world)?;
    Ok(world)
}

/// Another slot under `root` (a numbered `slot-N`, not a world) that has built something.
fn built_slot(root: &Path, except: &Path) -> Option<PathBuf> {
    let mut slots: Vec<PathBuf> = std::fs::read_dir(root)
        .ok()?
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            path != except
                && path.join("target").is_dir()
                && path
                    .file_name()
                    .and_then(|name| name.to_str()?.strip_prefix("slot-"))
                    .is_some_and(|n| n.chars().all(|c| c.is_ascii_digit()))
        })
        .collect();
    slots.sort();
    slots.into_iter().next()
}

/// Gives `into` a copy of `from`'s build of the dependencies (`from/target` → `into/target`):
/// build scripts and proc macros whole, and of the cells' target the dependencies' libraries,
/// build outputs and fingerprints; not the cells' own libraries nor their incremental state.
/// Fingerprints are copied first: a unit whose fingerprint was copied had finished writing
/// before, so the copy never pairs a fingerprint with a half-written library of a slot still
/// building. Not the lock file: cargo resolves the new slot's versions itself (an old slot's
/// pins may name versions an offline bundle does not have), and reuses what matches.
fn seed(from: &Path, into: &Path) -> anyhow::Result<()> {
    let partial = into.join("target.partial");
    let copied = copy_build(from, &partial);
    if copied.is_err() {
        let _ = std::fs::remove_dir_all(&partial);
    }
    copied
}

/// [`seed`]'s copy, into `partial`, renamed to `target` beside it once whole.
fn copy_build(from: &Path, partial: &Path) -> anyhow::Result<()> {
    let target = partial.with_file_name("target");
    let _ = std::fs::remove_dir_all(partial);
    std::fs::create_dir_all(partial)
        .with_context(|| format!("cannot create {}", partial.display()))?;
    let built = from.join("target");
    for entry in std::fs::read_dir(&built).into_iter().flatten().flatten() {
        let path = entry.path();
        if !path.is_dir() {
            copy(&path, partial)?;
        } else if entry.file_name() == "debug" {
            // Build scripts and proc macros, built for the host.
            copy(&path, partial)?;
        } else {
            // The cells' target (`x86_64-unknown-linux-gnu/debug/…`).
            let cells = path.join("debug");
            let copied = partial.join(entry.file_name()).join("debug");
            std::fs::create_dir_all(&copied)?;
            for part in [".fingerprint", "build", "deps"] {
                if cells.join(part).exists() {
                    copy(&cells.join(part), &copied)?;
                }
            }
        }
    }
    std::fs::rename(partial, &target).with_context(|| {
        format!(
            "cannot rename {} to {}",
            partial.display(),
            target.display()
        )
    })
}

/// Whether the world in `world` has the dependencies of the session in `main`, as evcxr last
/// wrote them into each one's manifest (each line of `main`'s `[dependencies]` in `world`'s).
fn builds_what(world: &Path, main: &Path) -> bool {
    let dependencies = |dir: &Path| -> Option<Vec<String>> {
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).ok()?;
        let section = manifest.split("[dependencies]").nth(1)?;
        Some(
            section
                .lines()
                .take_while(|line| !line.trim_start().starts_with('['))
                .map(str::trim)
                .filter(|line| !line.is_empty())
                .map(str::to_string)
                .collect(),
        )
    };
    match (dependencies(world), dependencies(main)) {
        (Some(world), Some(main)) => main.iter().all(|line| world.contains(line)),
        _ => false,
    }
}

/// `cp -a` (reflinks where the file system has them): keeps the times cargo compares.
fn copy(from: &Path, into: &Path) -> anyhow::Result<()> {
    let status = std::process::Command::new("cp")
        .args(["-a", "--reflink=auto"])
        .arg(from)
        .arg(into)
        .status()
        .context("cannot run cp")?;
    anyhow::ensure!(
        status.success(),
        "cp -a {} {} failed ({status})",
        from.display(),
        into.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::acquire;

    #[test]
    fn live_holders_get_distinct_slots_and_a_freed_slot_is_reused() {
        let root = std::env::temp_dir().join(format!("tchmem-workdir-{}", std::process::id()));
        let first = acquire(root.clone()).unwrap();
        let second = acquire(root.clone()).unwrap();
        assert_ne!(first.path, second.path);
        let first_path = first.path.clone();
        drop(first);
        let third = acquire(root.clone()).unwrap();
        assert_eq!(third.path, first_path);
        drop((second, third));
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_new_slot_starts_from_the_dependencies_another_slot_built() {
        let root = std::env::temp_dir().join(format!("tchmem-seed-{}", std::process::id()));
        let first = acquire(root.clone()).unwrap();
        let deps = first
            .path
            .join("target/x86_64-unknown-linux-gnu/debug/deps");
        std::fs::create_dir_all(&deps).unwrap();
        std::fs::write(deps.join("libtorch_sys.rlib"), "built").unwrap();
        // A world folder is not a slot to start from.
        std::fs::create_dir_all(root.join("slot-0-world/target")).unwrap();
        let second = acquire(root.clone()).unwrap();
        let copied = second
            .path
            .join("target/x86_64-unknown-linux-gnu/debug/deps");
        let library = std::fs::read_to_string(copied.join("libtorch_sys.rlib")).unwrap();
        assert_eq!(library, "built");
        assert!(!second.path.join("target.partial").exists());
        // A slot with a build of its own keeps it.
        std::fs::write(copied.join("libtorch_sys.rlib"), "its own").unwrap();
        drop(second);
        let again = acquire(root.clone()).unwrap();
        let kept = std::fs::read_to_string(copied.join("libtorch_sys.rlib")).unwrap();
        assert_eq!(kept, "its own");
        drop((first, again));
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_world_starts_from_the_dependencies_built_for_its_session() {
        let root = std::env::temp_dir().join(format!("tchmem-world-dir-{}", std::process::id()));
        let main = root.join("slot-0");
        let cells = main.join("target/x86_64-unknown-linux-gnu/debug");
        for dir in ["deps", "build", ".fingerprint", "incremental"] {
            std::fs::create_dir_all(cells.join(dir)).unwrap();
            std::fs::write(cells.join(dir).join("a"), dir).unwrap();
        }
        std::fs::write(cells.join("libcode_3.so"), "cell").unwrap();
        std::fs::create_dir_all(main.join("target/debug/build")).unwrap();
        std::fs::write(main.join("target/.rustc_info.json"), "{}").unwrap();
        let world = super::prepare_world(&main).unwrap();
        assert_eq!(world, root.join("slot-0-world"));
        let copied = world.join("target/x86_64-unknown-linux-gnu/debug");
        assert_eq!(
            std::fs::read_to_string(copied.join("deps/a")).unwrap(),
            "deps"
        );
        assert!(copied.join(".fingerprint/a").exists() && copied.join("build/a").exists());
        assert!(!copied.join("incremental").exists() && !copied.join("libcode_3.so").exists());
        assert!(world.join("target/debug/build").is_dir());
        assert!(world.join("target/.rustc_info.json").is_file());
        // Once made, the world's own build is kept while it has the session's dependencies.
        let manifest =
            |path: &str| format!("[package]\n[dependencies]\nrt = {{ path = \"{path}\" }}\n");
        std::fs::write(main.join("Cargo.toml"), manifest("/a/runtime")).unwrap();
        std::fs::write(world.join("Cargo.toml"), manifest("/a/runtime")).unwrap();
        std::fs::write(copied.join("deps/a"), "the world's").unwrap();
        super::prepare_world(&main).unwrap();
        let kept = std::fs::read_to_string(copied.join("deps/a")).unwrap();
        assert_eq!(kept, "the world's");
        // The session's crates moved (another checkout): the world starts again from its build.
        std::fs::write(main.join("Cargo.toml"), manifest("/b/runtime")).unwrap();
        super::prepare_world(&main).unwrap();
        let again = std::fs::read_to_string(copied.join("deps/a")).unwrap();
        assert_eq!(again, "deps");
        std::fs::remove_dir_all(root).unwrap();
    }
}
