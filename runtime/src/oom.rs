//! libtorch's out-of-memory observer (csrc/oom_observer.cpp): the device's state at the moment
//! the CUDA caching allocator gives up on a request, which the cell's record then carries (and
//! the kernel's `OutOfMemory` error quotes). The allocator's `num_ooms` counter moves at the
//! same moment; a request larger than the whole device fails before either.

use tchmem_wire::memory::OomEvent;

use crate::error::RuntimeError;
use crate::state;

#[cfg(tchmem_cuda_headers)]
extern "C" {
    fn tchmem_attach_oom_observer(
        callback: extern "C" fn(i64, u64, u64, u64),
        err: *mut std::ffi::c_char,
        err_len: usize,
    ) -> std::ffi::c_int;
}

/// The most events kept until the next record takes them: with recording off
/// (`TCHMEM_RECORD=0`) nothing takes them, and a loop that keeps hitting OOM must not grow them.
const MAX_KEPT_EVENTS: usize = 16;

/// Notes `event`, dropping the oldest beyond [`MAX_KEPT_EVENTS`].
fn keep(events: &mut Vec<OomEvent>, event: OomEvent) {
    if events.len() >= MAX_KEPT_EVENTS {
        events.drain(..=events.len() - MAX_KEPT_EVENTS);
    }
    events.push(event);
}

/// Called by libtorch when the allocator gives up: notes the event with the allocator's counters
/// and the watched tensors' bytes at that moment. libtorch calls observers after releasing the
/// allocator's lock, so reading its counters is safe; the watched tensors are read only if
/// their locks are free (this may run while any thread holds them).
#[cfg_attr(not(tchmem_cuda_headers), allow(dead_code))]
extern "C" fn on_oom(device: i64, requested: u64, device_total: u64, device_free: u64) {
    let current = crate::cuda_stats::device_stats(device)
        .ok()
        .map(|stats| stats.current);
    let known = crate::watch::try_known_bytes(tch::Device::Cuda(device as usize));
    let event = OomEvent {
        device,
        requested,
        device_total,
        device_free,
        allocated: current.map(|c| c.allocated),
        reserved: current.map(|c| c.reserved),
        parameters: known.map(|k| k.parameters),
        gradients: known.map(|k| k.gradients),
        input_batch: known.map(|k| k.input_batch),
    };
    let mut events = state::lock(&state::shared().oom_events);
    keep(&mut events, event);
}

/// Attaches the observer (once per process: the kernel does it when a session starts).
pub fn attach_observer() -> Result<(), RuntimeError> {
    if !tch::Cuda::is_available() {
        return Err(RuntimeError::NoCuda);
    }
    // The allocator hands observers to the per-device allocators that exist at the time, which
    // it creates on first use (measured on the H200: attached before, the observer never ran).
    drop(tch::Tensor::zeros(
        [1],
        (
            tch::Kind::Float,
            tch::Device::Cuda(crate::cuda_stats::DEVICE as usize),
        ),
    ));
    #[cfg(tchmem_cuda_headers)]
    {
        crate::ffi::call(|err, len| unsafe { tchmem_attach_oom_observer(on_oom, err, len) })
    }
    #[cfg(not(tchmem_cuda_headers))]
    {
        Err(RuntimeError::NoCudaHeaders("libtorch's OOM observer"))
    }
}

/// The events observed since the last call.
pub fn take_events() -> Vec<OomEvent> {
    std::mem::take(&mut *state::lock(&state::shared().oom_events))
}

#[cfg(test)]
mod tests {
    use super::{keep, OomEvent, MAX_KEPT_EVENTS};

    #[test]
    fn events_nobody_takes_stay_bounded_and_the_newest_are_kept() {
        let mut events = Vec::new();
        for requested in 0..100u64 {
            keep(
                &mut events,
                OomEvent {
                    device: 0,
                    requested,
                    device_total: 1,
                    device_free: 0,
                    ..Default::default()
                },
            );
        }
        assert_eq!(events.len(), MAX_KEPT_EVENTS);
        assert_eq!(events.first().map(|e| e.requested), Some(100 - 16));
        assert_eq!(events.last().map(|e| e.requested), Some(99));
    }
}
