//! The directory where evcxr compiles cells, kept between kernel runs.
//!
//! Compiling torch-sys for the cells takes minutes; evcxr keeps its build in `EVCXR_TMPDIR`, so a
//! kernel that reuses the previous kernel's directory starts in seconds. Two live kernels must
//! not share one, so each takes the first free numbered slot and holds an exclusive lock on it
//! for as long as it lives (the lock goes with the process, also when it is killed).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

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
            return Ok(Workdir { path, _lock: lock });
        }
    }
    anyhow::bail!(
        "all {MAX_SLOTS} compile directories under {} are in use by running kernels; \
         stop one, or set TCHMEM_WORKDIR to another directory",
        root.display()
    )
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
}
