//! The process's group: made by [`init`], kept in the runtime's process-wide state (each cell
//! links its own copy of this crate; the C++ object is one), ended by [`shutdown`].

use std::ffi::{c_char, c_int, c_void, CString};
use std::os::unix::ffi::OsStrExt;
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
/// The longest timeout taken (c10d adds it to the clock's time: no overflow).
const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

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
            Ok(text) => text
                .trim()
                .parse()
                .ok()
                .and_then(|seconds| Duration::try_from_secs_f64(seconds).ok())
                .ok_or_else(|| {
                    RuntimeError::Invalid(format!(
                        "TCHMEM_DIST_TIMEOUT_S is {text:?}, not a number of seconds"
                    ))
                })?,
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
    fn tchmem_dist_all_gather(
        group: *mut c_void,
        output: *mut C_tensor,
        input: *mut C_tensor,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_dist_reduce_scatter(
        group: *mut c_void,
        output: *mut C_tensor,
        input: *mut C_tensor,
        op: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
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
    if setup.timeout < Duration::from_millis(1) || setup.timeout > MAX_TIMEOUT {
        return Err(RuntimeError::Invalid(format!(
            "a timeout of {:?}: give one from 1 ms to a day",
            setup.timeout
        )));
    }
    let (Ok(rank), Ok(size)) = (
        c_int::try_from(setup.rank),
        c_int::try_from(setup.world_size),
    ) else {
        return Err(RuntimeError::Invalid(format!(
            "a world of {} ranks is more than c10d takes",
            setup.world_size
        )));
    };
    let store = CString::new(setup.store.as_os_str().as_bytes()).map_err(|_| {
        RuntimeError::Invalid(format!(
            "the store's path {:?} holds a NUL byte: give another",
            setup.store
        ))
    })?;
    let timeout_ms = setup.timeout.as_millis() as i64;
    let mut address: *mut c_void = std::ptr::null_mut();
    // SAFETY: the shim writes a new group's address into `address` when it returns 0.
    ffi::call(|err, len| unsafe {
        tchmem_dist_new_gloo(
            store.as_ptr(),
            rank,
            size,
            timeout_ms,
            &mut address,
            err,
            len,
        )
    })
    .map_err(|error| RuntimeError::Dist {
        rank: setup.rank,
        what: "joining the group".into(),
        why: format!(
            "{error} (every rank must start within the timeout and give the same store path; \
             a store file left by an earlier group must be removed first)"
        ),
    })?;
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

impl ReduceOp {
    /// The shim's number for it.
    fn code(self) -> c_int {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Max => 1,
            ReduceOp::Min => 2,
        }
    }
}

/// Combines `tensor` across the ranks, in place: after it every rank holds the result.
pub fn all_reduce(tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
    let op = op.code();
    through_contiguous(tensor, |tensor| {
        let pointer = tensor.as_mut_ptr();
        collective("an all-reduce", |group, err, len| unsafe {
            tchmem_dist_all_reduce(group, pointer, op, err, len)
        })
    })
}

/// Runs `collective` on `tensor`, or on a contiguous copy that is then copied back (Gloo reads
/// and writes a tensor's elements from its data pointer on).
fn through_contiguous(
    tensor: &mut Tensor,
    collective: impl FnOnce(&mut Tensor) -> Result<()>,
) -> Result<()> {
    if tensor.is_contiguous() {
        return collective(tensor);
    }
    let mut copy = tensor.contiguous();
    collective(&mut copy)?;
    tensor.f_copy_(&copy).map_err(|error| {
        RuntimeError::Invalid(format!("the result cannot be written back: {error}"))
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
    through_contiguous(tensor, |tensor| {
        let pointer = tensor.as_mut_ptr();
        collective("a broadcast", |group, err, len| unsafe {
            tchmem_dist_broadcast(group, pointer, root as c_int, err, len)
        })
    })
}

/// Every rank's `input` side by side in rank order: `input`'s elements times the world size,
/// flat (what a rank needs to rebuild a tensor sharded over the ranks). Without a group, a flat
/// copy of `input`.
pub fn all_gather(input: &Tensor) -> Result<Tensor> {
    let world = world_size() as i64;
    let mut input = input.contiguous().reshape([-1]);
    let mut output = Tensor::empty(
        [world * input.numel() as i64],
        (input.kind(), input.device()),
    );
    if world == 1 {
        output.copy_(&input);
        return Ok(output);
    }
    let (out, inp) = (output.as_mut_ptr(), input.as_mut_ptr());
    collective("an all-gather", |group, err, len| unsafe {
        tchmem_dist_all_gather(group, out, inp, err, len)
    })?;
    Ok(output)
}

/// `input` combined across the ranks, of which this rank gets its share: `input`'s elements are
/// split into world-size equal slices, and rank r gets slice r of the result, flat (what a rank
/// keeps of gradients sharded over the ranks). Without a group, a flat copy of `input`.
pub fn reduce_scatter(input: &Tensor, op: ReduceOp) -> Result<Tensor> {
    let world = world_size() as i64;
    let mut input = input.contiguous().reshape([-1]);
    let elements = input.numel() as i64;
    if elements % world != 0 {
        return Err(RuntimeError::Invalid(format!(
            "a reduce-scatter of {elements} elements over {world} ranks: pad it to a multiple \
             of the world size"
        )));
    }
    let mut output = Tensor::empty([elements / world], (input.kind(), input.device()));
    if world == 1 {
        output.copy_(&input);
        return Ok(output);
    }
    if op != ReduceOp::Sum {
        // Gloo's reduce-scatter sums whatever op it is given (libtorch 2.11 makes it an
        // all-reduce of a copy with the default op): the same, with the op.
        let mut whole = input.copy();
        all_reduce(&mut whole, op)?;
        let slice = elements / world;
        return Ok(whole.narrow(0, rank() as i64 * slice, slice).copy());
    }
    let (out, inp, op) = (output.as_mut_ptr(), input.as_mut_ptr(), op.code());
    collective("a reduce-scatter", |group, err, len| unsafe {
        tchmem_dist_reduce_scatter(group, out, inp, op, err, len)
    })?;
    Ok(output)
}

/// Runs a shim collective on the group; without one (a world of 1) there is nothing to do.
/// The group's lock is held while it runs, so that no [`shutdown`] frees it meanwhile (and
/// [`rank`] on another thread waits for it). After a failed collective the ranks are out of
/// step: [`shutdown`], then [`init`] a new group with a fresh store.
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
