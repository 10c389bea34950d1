//! How long the GPU worked during one step of a trial (csrc/busy_time.cpp): libtorch's kineto
//! profiler over the device's kernels, copies and memsets. A trial's wall time at a small batch
//! is mostly the host launching kernels, which barely grows with the batch; the device's work
//! does, and the memory estimate predicts a step from its line.

use std::ffi::{c_char, c_int, OsStr};
use std::time::Duration;

use crate::cuda_stats::DEVICE;
use crate::error::Result;
use crate::ffi::call;

extern "C" {
    fn tchmem_busy_start(device: c_int, err: *mut c_char, err_len: usize) -> c_int;
    fn tchmem_busy_stop(
        device: c_int,
        index: c_int,
        busy_ns: *mut u64,
        events: *mut usize,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_busy_abandon();
}

/// `TCHMEM_GPU_WORK=0` in the kernel's environment (which its child inherits) leaves the
/// profiled step out of every trial: a way around a GPU set-up where the profiler (CUPTI)
/// misbehaves, at the price of the step time's GPU line.
pub(crate) const ENV: &str = "TCHMEM_GPU_WORK";

/// Whether trials profile the GPU's work (see [`ENV`]).
pub(crate) fn wanted() -> bool {
    wanted_by(std::env::var_os(ENV).as_deref())
}

fn wanted_by(value: Option<&OsStr>) -> bool {
    value.is_none_or(|v| v != "0")
}

/// What one profiled stretch of work measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Busy {
    /// The union of the profiled events' intervals.
    pub time: Duration,
    /// How many events there were.
    pub events: usize,
}

/// What to profile: the device's work, or (on a machine without one, for tests) the host's
/// operators through the same profiler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activity {
    /// CUDA kernels, copies and memsets.
    Device,
    /// libtorch's operators on the host.
    #[cfg_attr(not(test), allow(dead_code))]
    Host,
}

impl Activity {
    fn code(self) -> c_int {
        match self {
            Activity::Device => 1,
            Activity::Host => 0,
        }
    }
}

/// Starts profiling `activity` (the profiler's set-up is paid here, not in what it measures);
/// fails where a profile is on already. Stopped on the same thread.
pub(crate) fn start(activity: Activity) -> Result<()> {
    // SAFETY: a plain argument and the error buffer.
    call(|e, n| unsafe { tchmem_busy_start(activity.code(), e, n) })
}

/// Stops the profile [`start`] began: how long `activity` was busy (on the session's device
/// for the device's work, which must be finished first: synchronise before).
pub(crate) fn stop(activity: Activity) -> Result<Busy> {
    let (mut busy_ns, mut events) = (0u64, 0usize);
    // SAFETY: out-pointers to locals and the error buffer.
    call(|e, n| unsafe {
        tchmem_busy_stop(
            activity.code(),
            DEVICE as c_int,
            &mut busy_ns,
            &mut events,
            e,
            n,
        )
    })?;
    Ok(Busy {
        time: Duration::from_nanos(busy_ns),
        events,
    })
}

/// Stops a profile this thread left on (a cell interrupted or failed in a trial's profiled
/// step), discarding it; nothing when none is on.
pub(crate) fn abandon() {
    // SAFETY: no arguments; the shim catches every exception.
    unsafe { tchmem_busy_abandon() }
}

/// The profiler is process-wide: one test profiles at a time.
#[cfg(test)]
pub(crate) fn one_profile_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static PROFILE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    PROFILE.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn only_zero_turns_the_profiled_step_off() {
        assert!(wanted_by(None));
        assert!(wanted_by(Some(OsStr::new("1"))));
        assert!(!wanted_by(Some(OsStr::new("0"))));
    }

    #[test]
    fn the_profiler_measures_the_work_between_start_and_stop() {
        let _profile = one_profile_at_a_time();
        // The host's operators on any machine: the device's kernels go through the same calls.
        let a = Tensor::rand([256, 256], (Kind::Float, Device::Cpu));
        start(Activity::Host).unwrap();
        let mut x = a.shallow_clone();
        for _ in 0..20 {
            x = x.matmul(&a).tanh();
        }
        let _ = x.sum(Kind::Float).double_value(&[]);
        let busy = stop(Activity::Host).unwrap();
        assert!(busy.events >= 40, "{busy:?}");
        assert!(busy.time > Duration::ZERO, "{busy:?}");
        // Nothing between: the next profile is empty.
        start(Activity::Host).unwrap();
        let idle = stop(Activity::Host).unwrap();
        assert_eq!(idle.events, 0, "{idle:?}");
        assert!(idle.time < busy.time);

        // A profile left on refuses another start until it is abandoned.
        start(Activity::Host).unwrap();
        let refused = start(Activity::Host).unwrap_err().to_string();
        assert!(refused.contains("already on"), "{refused}");
        abandon();
        start(Activity::Host).unwrap();
        stop(Activity::Host).unwrap();
        abandon(); // none on: nothing
    }
}
