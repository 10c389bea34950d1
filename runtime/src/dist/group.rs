//! The process's group: made by [`init`], kept in the runtime's process-wide state (each cell
//! links its own copy of this crate; the C++ object is one), ended by [`shutdown`].

use std::ffi::{c_char, c_int, c_void, CString};
use std::path::PathBuf;
use std::time::Duration;

use tch::Tensor;
use torch_sys::C_tensor;

use crate::error::{Result, RuntimeError};
use crate::ffi;
use crate::state::{lock, shared, DistGroup};

/// How long a collective waits for the other ranks before it fails (a rank that crashed or never
/// reached it): `TCHMEM_DIST_TIMEOUT_S` overrides it.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Where this process stands in a group, and how the ranks meet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setup {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// How many processes the group has.
    pub world_size: usize,
    /// The file every rank meets through: the same path in each, absent or empty before the
    /// first rank starts.
    pub store: PathBuf,
    /// How long a collective waits for the other ranks.
    pub timeout: Duration,
}

impl Setup {
    /// The setup the environment gives (`TCHMEM_RANK`, `TCHMEM_WORLD_SIZE`, `TCHMEM_DIST_STORE`,
    /// optionally `TCHMEM_DIST_TIMEOUT_S`), as a launcher sets it for each rank.
    pub fn from_env() -> Result<Setup> {
        let read = |name: &str| -> Result<String> {
            std::env::var(name).map_err(|_| {
                RuntimeError::Invalid(format!(
                    "{name} is not set: start each rank with TCHMEM_RANK, TCHMEM_WORLD_SIZE and \
                     TCHMEM_DIST_STORE (or call tchmem::dist::init with a Setup)"
                ))
            })
        };
        let number = |name: &str| -> Result<usize> {
            let text = read(name)?;
            text.trim().parse().map_err(|_| {
                RuntimeError::Invalid(format!("{name} is {text:?}, not a whole number"))
            })
        };
        let timeout = match std::env::var("TCHMEM_DIST_TIMEOUT_S") {
            Ok(text) => Duration::from_secs_f64(text.trim().parse().map_err(|_| {
                RuntimeError::Invalid(format!(
                    "TCHMEM_DIST_TIMEOUT_S is {text:?}, not a number of seconds"
                ))
            })?),
            Err(_) => DEFAULT_TIMEOUT,
        };
        Ok(Setup {
            rank: number("TCHMEM_RANK")?,
            world_size: number("TCHMEM_WORLD_SIZE")?,
            store: PathBuf::from(read("TCHMEM_DIST_STORE")?),
            timeout,
        })
    }
}

/// How [`all_reduce`] combines the ranks' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Their sum.
    Sum,
    /// Their largest element, element by element.
    Max,
    /// Their smallest element, element by element.
    Min,
}

extern "C" {
    fn tchmem_dist_new_gloo(
        store_path: *const c_char,
        rank: c_int,
        size: c_int,
        timeout_ms: i64,
        out: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_dist_free(group: *mut c_void);
    fn tchmem_dist_all_reduce(
        group: *mut c_void,
        tensor: *mut C_tensor,
        op: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_dist_broadcast(
        group: *mut c_void,
        tensor: *mut C_tensor,
        root: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_dist_barrier(group: *mut c_void, err: *mut c_char, err_len: usize) -> c_int;
}

/// Joins the group `setup` describes; returns once every rank has joined (or fails after the
/// setup's timeout). A process is in one group at a time: call [`shutdown`] before another.
pub fn init(setup: &Setup) -> Result<()> {
    if setup.world_size == 0 || setup.rank >= setup.world_size {
        return Err(RuntimeError::Invalid(format!(
            "rank {} of {}: a rank is 0 up to the world size, which is at least 1",
            setup.rank, setup.world_size
        )));
    }
    let mut current = lock(&shared().dist);
    if let Some(group) = current.as_ref() {
        return Err(RuntimeError::Invalid(format!(
            "this process is already rank {} of {}: call tchmem::dist::shutdown() first",
            group.rank, group.world_size
        )));
    }
    let store = CString::new(setup.store.to_string_lossy().as_bytes())
        .map_err(|_| RuntimeError::Invalid("the store's path holds a NUL byte".into()))?;
    let timeout_ms = i64::try_from(setup.timeout.as_millis()).unwrap_or(i64::MAX);
    let mut address: *mut c_void = std::ptr::null_mut();
    // SAFETY: the shim writes a new group's address into `address` when it returns 0.
    ffi::call(|err, len| unsafe {
        tchmem_dist_new_gloo(
            store.as_ptr(),
            setup.rank as c_int,
            setup.world_size as c_int,
            timeout_ms,
            &mut address,
            err,
            len,
        )
    })
    .map_err(|error| failed(setup.rank, "joining the group", error))?;
    *current = Some(DistGroup {
        rank: setup.rank,
        world_size: setup.world_size,
        address: address as usize,
    });
    Ok(())
}

/// Leaves the group (the next [`init`] may join another). Without a group, nothing happens.
pub fn shutdown() {
    if let Some(group) = lock(&shared().dist).take() {
        // SAFETY: the address came from tchmem_dist_new_gloo and is freed once (taken above).
        unsafe { tchmem_dist_free(group.address as *mut c_void) };
    }
}

/// This process's rank (0 without a group).
pub fn rank() -> usize {
    lock(&shared().dist).as_ref().map_or(0, |group| group.rank)
}

/// How many processes the group has (1 without a group).
pub fn world_size() -> usize {
    lock(&shared().dist)
        .as_ref()
        .map_or(1, |group| group.world_size)
}

/// Returns once every rank has called it.
pub fn barrier() -> Result<()> {
    collective("a barrier", |group, err, len| unsafe {
        tchmem_dist_barrier(group, err, len)
    })
}

/// Combines `tensor` across the ranks, in place: after it every rank holds the result.
pub fn all_reduce(tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
    let op = match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
    };
    let pointer = tensor.as_mut_ptr();
    collective("an all-reduce", |group, err, len| unsafe {
        tchmem_dist_all_reduce(group, pointer, op, err, len)
    })
}

/// Copies rank `root`'s `tensor` into every rank's (same shape and kind on each).
pub fn broadcast(tensor: &mut Tensor, root: usize) -> Result<()> {
    let world = world_size();
    if root >= world {
        return Err(RuntimeError::Invalid(format!(
            "a broadcast from rank {root} in a group of {world}"
        )));
    }
    let pointer = tensor.as_mut_ptr();
    collective("a broadcast", |group, err, len| unsafe {
        tchmem_dist_broadcast(group, pointer, root as c_int, err, len)
    })
}

/// Runs a shim collective on the group; without one (a world of 1) there is nothing to do.
/// The group's lock is held while it runs, so that no [`shutdown`] frees it meanwhile.
fn collective(
    what: &str,
    call: impl FnOnce(*mut c_void, *mut c_char, usize) -> c_int,
) -> Result<()> {
    let current = lock(&shared().dist);
    let Some(group) = current.as_ref() else {
        return Ok(());
    };
    ffi::call(|err, len| call(group.address as *mut c_void, err, len))
        .map_err(|error| failed(group.rank, what, error))
}

/// A collective's failure, with the rank it failed on and what usually causes it.
fn failed(rank: usize, what: &str, error: RuntimeError) -> RuntimeError {
    RuntimeError::Dist {
        rank,
        what: what.to_string(),
        why: error.to_string(),
    }
}
