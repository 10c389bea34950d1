//! Activation checkpointing: a segment's activations are not kept for backward; backward runs the
//! segment again (same dropout masks, same autocast) up to the last tensor its backward needs.
//! Trades most of one extra forward pass for the memory of the segment's activations.
//!
//! [`seq`] and [`seq_t`] build models exactly like tch's `nn::seq()` / `nn::seq_t()`, split into
//! segments (√N by default) of which all but the last are checkpointed:
//!
//! ```no_run
//! # use tch::nn::{self, Module};
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let model = tchmem::checkpoint::seq()
//!     .add(nn::linear(vs.root() / "l1", 784, 4096, Default::default()))
//!     .add_fn(|x| x.relu())
//!     .add(nn::linear(vs.root() / "l2", 4096, 10, Default::default()));
//! ```

use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use tch::nn::{Module, ModuleT};
use tch::Tensor;
use torch_sys::C_tensor;

use crate::ffi;

type SegmentFn = Box<dyn Fn(&Tensor) -> Tensor + Send>;

extern "C" {
    fn tchmem_checkpoint(
        data: *mut c_void,
        call: extern "C" fn(*mut c_void, *mut C_tensor, *mut c_char, usize) -> *mut C_tensor,
        drop: extern "C" fn(*mut c_void),
        input: *const C_tensor,
        offload: c_int,
        compression: c_int,
        out: *mut *mut C_tensor,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// The message with which the shim stops a rerun once it has every tensor backward needs
/// (csrc/checkpoint.cpp): the segment's next tch call fails with it and the closure panics.
const RECOMPUTE_COMPLETE: &str = "tchmem: checkpoint recompute complete";

/// Whether a panic is a rerun being stopped on purpose (nobody needs to hear about it).
pub(crate) fn is_rerun_stop(payload: &(dyn std::any::Any + Send)) -> bool {
    ffi::panic_text(payload).contains(RECOMPUTE_COMPLETE)
}

/// Keeps the panic hook in place quiet about stopped reruns (the kernel's own hook is too).
fn quiet_rerun_stops() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !is_rerun_stop(info.payload()) {
                previous(info)
            }
        }));
    });
}

/// Runs the segment for the shim, which may call from an autograd thread. A panic is caught
/// (it must not unwind into C++) and reported as an error, which libtorch raises.
extern "C" fn call_segment(
    data: *mut c_void,
    input: *mut C_tensor,
    err: *mut c_char,
    err_len: usize,
) -> *mut C_tensor {
    // SAFETY: `data` is the boxed closure made by `checkpoint`, alive until `drop_segment`;
    // `input` is a new tensor the shim hands over.
    let segment = unsafe { &*(data as *const SegmentFn) };
    let input = unsafe { Tensor::from_ptr(input) };
    match catch_unwind(AssertUnwindSafe(|| segment(&input))) {
        Ok(mut output) => {
            let raw = output.as_mut_ptr();
            // The shim takes ownership of the C++ tensor.
            std::mem::forget(output);
            raw
        }
        Err(panic) => {
            ffi::write_error(&ffi::panic_text(&*panic), err, err_len);
            std::ptr::null_mut()
        }
    }
}

extern "C" fn drop_segment(data: *mut c_void) {
    // SAFETY: made by Box::into_raw in `checkpoint`, dropped once by the shim.
    drop(unsafe { Box::from_raw(data as *mut SegmentFn) });
}

/// Runs `segment` on `input` without keeping its activations for backward; backward runs it
/// again, stopping as soon as it has the last tensor backward needs (as PyTorch's non-reentrant
/// checkpoint does). The closure must be a pure function of its input and the parameters it
/// captures (random ops are replayed with the same RNG state and autocast settings). Without
/// grad mode it simply runs.
///
/// The forward builds the segment's graph as usual (only the tensors it saves are dropped), so
/// `loss.backward()`, optimizers and `Tensor::run_backward(…, inputs)` work as without
/// checkpointing; double backward (`create_graph`) through a segment does not.
///
/// Backward fails with a clear error when the rerun saves tensors of other shapes than the
/// forward did, when a saved tensor or the input was modified in place in between, or when a
/// segment runs autograd on itself inside its forward. What is not saved cannot be checked:
/// the segment must not depend on state changed between forward and backward. The rerun is
/// stopped by unwinding the closure: state it changes (a BatchNorm's running statistics) is
/// changed twice, as with PyTorch's checkpoint, and a `Mutex` it holds while stopped is
/// poisoned.
///
/// # Panics
/// If the segment panics or libtorch reports an error (the message is passed on).
pub fn checkpoint<F>(segment: F, input: &Tensor) -> Tensor
where
    F: Fn(&Tensor) -> Tensor + Send + 'static,
{
    checkpoint_with(segment, input, Keep::default())
}

/// How a segment's activations are compressed while they wait for backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// 8-bit integers with a scale per row (the last dimension): absmax / 127, rounded, so each
    /// element is off by at most half its row's scale.
    Int8,
    /// 8-bit floats (e4m3) with a scale per row: absmax / 448 (3 bits of mantissa).
    Fp8,
}

impl Compression {
    /// The shim's code for it.
    fn code(this: Option<Compression>) -> c_int {
        match this {
            None => 0,
            Some(Compression::Int8) => 1,
            Some(Compression::Fp8) => 2,
        }
    }
}

/// Where a checkpointed segment keeps its input (the only activation checkpointing keeps)
/// until backward reruns the segment. The default keeps it on the device as it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Keep {
    /// In pinned host memory: copied on a side stream once the segment has run (the device
    /// memory is freed when the copy is done), and brought back one segment ahead of the rerun
    /// that needs it, so about one segment's input is on the device at a time. Exact.
    pub offload: bool,
    /// Quantized (a quarter of f32's bytes, half of bf16's); the rerun, and so the gradients,
    /// see the dequantized input.
    pub compression: Option<Compression>,
}

/// [`checkpoint`], keeping the segment's input as `keep` says (offloaded to the host, or
/// quantized, or both). Without CUDA an offloaded input is a copy in host memory.
///
/// # Panics
/// As [`checkpoint`].
pub fn checkpoint_with<F>(segment: F, input: &Tensor, keep: Keep) -> Tensor
where
    F: Fn(&Tensor) -> Tensor + Send + 'static,
{
    quiet_rerun_stops();
    let boxed: Box<SegmentFn> = Box::new(Box::new(segment));
    let data = Box::into_raw(boxed) as *mut c_void;
    let mut out: *mut C_tensor = std::ptr::null_mut();
    let status = ffi::call(|err, len| unsafe {
        tchmem_checkpoint(
            data,
            call_segment,
            drop_segment,
            input.as_ptr(),
            c_int::from(keep.offload),
            Compression::code(keep.compression),
            &mut out,
            err,
            len,
        )
    });
    match status {
        // SAFETY: the shim returned a new tensor that we now own.
        Ok(()) => unsafe { Tensor::from_ptr(out) },
        Err(message) => panic!("{message}"),
    }
}

/// Segment boundaries for `layers` layers in `segments` segments (at least one layer each).
fn segment_ranges(layers: usize, segments: Option<usize>) -> Vec<std::ops::Range<usize>> {
    if layers == 0 {
        return Vec::new();
    }
    let default = (layers as f64).sqrt().ceil() as usize;
    let segments = segments.unwrap_or(default).clamp(1, layers);
    let size = layers.div_ceil(segments);
    (0..layers)
        .step_by(size)
        .map(|start| start..(start + size).min(layers))
        .collect()
}

/// A layer shared between the model and the segments that backward may still run.
type Shared<M> = Arc<Mutex<Box<M>>>;

/// Layers split into segments, all but the last run through [`checkpoint`]: the part
/// [`Sequential`] and [`SequentialT`] share.
struct Segmented<M: ?Sized> {
    layers: Vec<Shared<M>>,
    segments: Option<usize>,
    keep: Keep,
}

impl<M: ?Sized> Default for Segmented<M> {
    fn default() -> Self {
        Segmented {
            layers: Vec::new(),
            segments: None,
            keep: Keep::default(),
        }
    }
}

impl<M: ?Sized> std::fmt::Debug for Segmented<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segmented")
            .field("layers", &self.layers.len())
            .field("segments", &self.segments)
            .field("keep", &self.keep)
            .finish()
    }
}

impl<M: ?Sized + Send + 'static> Segmented<M> {
    fn push(&mut self, layer: Box<M>) {
        self.layers.push(Arc::new(Mutex::new(layer)));
    }

    /// Runs the layers on `xs`, each through `apply(layer, x, train)`.
    fn forward(&self, xs: &Tensor, train: bool, apply: fn(&M, &Tensor, bool) -> Tensor) -> Tensor {
        let run = move |layers: &[Shared<M>], input: &Tensor| {
            let mut x = input.shallow_clone();
            for layer in layers {
                let layer = crate::state::lock(layer);
                x = apply(&layer, &x, train);
            }
            x
        };
        let ranges = segment_ranges(self.layers.len(), self.segments);
        // The last segment's activations are needed at once by backward: keep them.
        let last = ranges.len().saturating_sub(1);
        let keep = self.keep;
        let mut x = xs.shallow_clone();
        for (i, range) in ranges.into_iter().enumerate() {
            let layers = self.layers[range].to_vec();
            x = if i == last {
                run(&layers, &x)
            } else {
                checkpoint_with(move |x| run(&layers, x), &x, keep)
            };
        }
        x
    }
}

/// The builder methods both checkpointed sequentials share (each has its own `add`).
macro_rules! segmented_builder {
    ($model:ty) => {
        impl $model {
            /// Appends a closure.
            pub fn add_fn<F>(self, f: F) -> Self
            where
                F: 'static + Fn(&Tensor) -> Tensor + Send,
            {
                self.add(tch::nn::func(f))
            }

            /// Splits the layers into `segments` segments (default: √N rounded up).
            pub fn segments(mut self, segments: usize) -> Self {
                self.0.segments = Some(segments);
                self
            }

            /// Keeps the segments' inputs in pinned host memory until backward (see
            /// [`Keep::offload`]).
            pub fn offload(mut self) -> Self {
                self.0.keep.offload = true;
                self
            }

            /// Keeps the segments' inputs quantized until backward (see [`Compression`]).
            pub fn compress(mut self, compression: Compression) -> Self {
                self.0.keep.compression = Some(compression);
                self
            }

            /// The number of layers.
            pub fn len(&self) -> usize {
                self.0.layers.len()
            }

            /// Whether there are no layers.
            pub fn is_empty(&self) -> bool {
                self.0.layers.is_empty()
            }
        }
    };
}

/// Like tch's `nn::Sequential`, with all segments but the last checkpointed.
#[derive(Debug, Default)]
pub struct Sequential(Segmented<dyn Module>);

/// An empty checkpointed sequential model (the counterpart of `nn::seq()`).
pub fn seq() -> Sequential {
    Sequential::default()
}

impl Sequential {
    /// Appends a layer.
    #[allow(clippy::should_implement_trait)]
    pub fn add<M: Module + 'static>(mut self, layer: M) -> Self {
        self.0.push(Box::new(layer));
        self
    }
}

segmented_builder!(Sequential);

impl Module for Sequential {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.0.forward(xs, false, |layer, x, _| layer.forward(x))
    }
}

/// Like tch's `nn::SequentialT` (layers with a train flag), with all segments but the last
/// checkpointed.
#[derive(Debug, Default)]
pub struct SequentialT(Segmented<dyn ModuleT>);

/// An empty checkpointed sequential model with a train flag (the counterpart of `nn::seq_t()`).
pub fn seq_t() -> SequentialT {
    SequentialT::default()
}

impl SequentialT {
    /// Appends a layer.
    #[allow(clippy::should_implement_trait)]
    pub fn add<M: ModuleT + 'static>(mut self, layer: M) -> Self {
        self.0.push(Box::new(layer));
        self
    }

    /// Appends a closure that takes the train flag.
    pub fn add_fn_t<F>(self, f: F) -> Self
    where
        F: 'static + Fn(&Tensor, bool) -> Tensor + Send,
    {
        self.add(tch::nn::func_t(f))
    }
}

segmented_builder!(SequentialT);

impl ModuleT for SequentialT {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.0
            .forward(xs, train, |layer, x, train| layer.forward_t(x, train))
    }
}

#[cfg(test)]
mod tests {
    use super::segment_ranges;

    #[test]
    fn square_root_segments_by_default() {
        assert_eq!(segment_ranges(9, None), vec![0..3, 3..6, 6..9]);
        assert_eq!(segment_ranges(10, None), vec![0..3, 3..6, 6..9, 9..10]);
        assert_eq!(segment_ranges(2, Some(5)), vec![0..1, 1..2]);
        assert_eq!(segment_ranges(5, Some(1)), vec![0..5]);
        assert!(segment_ranges(0, None).is_empty());
    }
}
