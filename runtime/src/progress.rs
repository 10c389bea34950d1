//! What a running loop tells the live view beyond the iterations the kernel counts: its step
//! and total (a bar and a time left, through [`crate::progress()`]) and its loss ([`loss`]).

use tch::Tensor;

use tchmem_wire::progress::Progress;

use crate::interrupt::run_state;

/// What the running cell has reported so far (its loops' iterations, step, loss), as the live
/// view's next sample will show it.
pub fn snapshot() -> Progress {
    run_state().progress()
}

/// Reports the step the loop is at, of `total` (pass `0` when the total is unknown). Cheap: two
/// atomic stores, nothing sent until the view samples it.
pub fn report<S: TryInto<u64>, T: TryInto<u64>>(step: S, total: T) {
    let step = step.try_into().unwrap_or(0);
    let total = total.try_into().ok().filter(|&t| t > 0);
    run_state().set_progress(step, total);
}

/// A loss value the view can show: a number, or a one-element tensor.
pub trait LossValue {
    /// The value as `f64`.
    fn loss_value(&self) -> f64;
}

impl LossValue for f64 {
    fn loss_value(&self) -> f64 {
        *self
    }
}

impl LossValue for f32 {
    fn loss_value(&self) -> f64 {
        f64::from(*self)
    }
}

/// Reading a CUDA tensor waits for the GPU: pass a tensor every few steps, or a number you
/// already have.
impl LossValue for Tensor {
    fn loss_value(&self) -> f64 {
        self.double_value(&[])
    }
}

impl<T: LossValue + ?Sized> LossValue for &T {
    fn loss_value(&self) -> f64 {
        (**self).loss_value()
    }
}

/// Reports the last loss (shown in the live view).
pub fn loss(value: impl LossValue) {
    run_state().set_loss(value.loss_value());
}
