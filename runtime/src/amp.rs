//! Mixed precision: [`autocast`] with a chosen dtype (bf16 or f16; tch's own `tch::autocast`
//! only toggles CUDA autocast at f16), and a dynamic [`GradScaler`] for f16 training, built on
//! libtorch's `_amp_*` ops like PyTorch's `torch.amp.GradScaler`.
//!
//! ```no_run
//! # use tch::{nn, nn::Module, nn::OptimizerConfig, Kind, Tensor};
//! # let vs = nn::VarStore::new(tch::Device::Cpu);
//! # let model = nn::linear(vs.root(), 4, 1, Default::default());
//! # let mut opt = nn::Adam::default().build(&vs, 1e-3).unwrap();
//! # let x = Tensor::zeros([2, 4], (Kind::Float, tch::Device::Cpu));
//! let mut scaler = tchmem::amp::GradScaler::new(&vs);
//! let loss = tchmem::amp::autocast(Kind::Half, || model.forward(&x).square().mean(Kind::Float));
//! scaler.backward_step(&mut opt, &loss); // skipped if a gradient is inf/nan
//! ```

use std::ffi::c_int;

use tch::{nn, Device, Kind, Tensor};
use torch_sys::C_tensor;

use crate::ffi;
use crate::optim::Step;

extern "C" {
    fn tchmem_autocast_get(
        cuda: c_int,
        enabled: *mut c_int,
        dtype: *mut c_int,
        err: *mut std::ffi::c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_autocast_set(
        cuda: c_int,
        enabled: c_int,
        dtype: c_int,
        entering: c_int,
        err: *mut std::ffi::c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_onednn_off_for(
        dtype: c_int,
        before: *mut c_int,
        err: *mut std::ffi::c_char,
        err_len: usize,
    ) -> c_int;
    fn tchmem_onednn_set(enabled: c_int, err: *mut std::ffi::c_char, err_len: usize) -> c_int;
    fn tchmem_amp_unscale(
        grads: *const *mut C_tensor,
        n: usize,
        found_inf: *mut C_tensor,
        inv_scale: *const C_tensor,
        err: *mut std::ffi::c_char,
        err_len: usize,
    ) -> c_int;
}

/// c10::ScalarType numbers of the dtypes autocast takes.
fn scalar_type(kind: Kind) -> c_int {
    match kind {
        Kind::Half => 5,
        Kind::Float => 6,
        Kind::BFloat16 => 15,
        other => panic!("autocast runs in Kind::BFloat16 or Kind::Half, not {other:?}"),
    }
}

/// Runs `f` with autocast on for `device`'s type (CUDA or CPU) at `dtype` (`Kind::BFloat16` or
/// `Kind::Half`): matmuls and convolutions run in that dtype, reductions and losses in f32.
/// The previous setting is restored afterwards, also if `f` panics.
///
/// Where oneDNN cannot run an LSTM in `dtype` (bf16 on a CPU without AVX-512 BF16; f16 on any
/// CPU), oneDNN is off inside: libtorch 2.11's CPU autocast would hand an LSTM's oneDNN kernel a
/// dtype it cannot run. The LSTM then runs libtorch's own cells, their matmuls in `dtype`.
pub fn autocast_on<T>(device: Device, dtype: Kind, f: impl FnOnce() -> T) -> T {
    let cuda = c_int::from(device.is_cuda());
    let dtype = scalar_type(dtype);
    let (mut enabled, mut previous) = (0, 0);
    ffi::call(|err, len| unsafe {
        tchmem_autocast_get(cuda, &mut enabled, &mut previous, err, len)
    })
    .unwrap_or_else(|e| panic!("reading the autocast state: {e}"));
    ffi::call(|err, len| unsafe { tchmem_autocast_set(cuda, 1, dtype, 1, err, len) })
        .unwrap_or_else(|e| panic!("enabling autocast: {e}"));
    // Restores on the way out, panics included: autocast, then oneDNN where this level turned
    // it off (each level undoes only its own change, whichever cell's copy of the runtime it is).
    struct Restore {
        cuda: c_int,
        enabled: c_int,
        dtype: c_int,
        onednn_before: c_int,
    }
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = ffi::call(|err, len| unsafe {
                tchmem_autocast_set(self.cuda, self.enabled, self.dtype, 0, err, len)
            });
            if self.onednn_before >= 0 {
                let _ = ffi::call(|err, len| unsafe {
                    tchmem_onednn_set(self.onednn_before, err, len)
                });
            }
        }
    }
    let mut restore = Restore {
        cuda,
        enabled,
        dtype: previous,
        onednn_before: -1,
    };
    if cuda == 0 {
        ffi::call(|err, len| unsafe {
            tchmem_onednn_off_for(dtype, &mut restore.onednn_before, err, len)
        })
        .unwrap_or_else(|e| panic!("asking oneDNN for {dtype}: {e}"));
    }
    f()
}

/// [`autocast_on`] the CUDA device when CUDA is available, else the CPU.
pub fn autocast<T>(dtype: Kind, f: impl FnOnce() -> T) -> T {
    autocast_on(Device::cuda_if_available(), dtype, f)
}

/// Dynamic loss scaling for f16 training: the loss is multiplied by a large scale so small
/// gradients do not underflow in f16; gradients are unscaled before the step; a step whose
/// gradients hold inf/nan is skipped and the scale halved; after `growth_interval` good steps
/// the scale doubles. The defaults are PyTorch's.
pub struct GradScaler {
    /// The VarStore's variables, read at each unscale: like tch's optimizers, the scaler sees
    /// variables added after it was made.
    variables: std::sync::Arc<std::sync::Mutex<nn::Variables>>,
    scale: Tensor,
    growth_tracker: Tensor,
    /// Multiplier after `growth_interval` steps without inf/nan (2.0).
    pub growth_factor: f64,
    /// Multiplier after a step with inf/nan (0.5).
    pub backoff_factor: f64,
    /// Good steps between growths (2000).
    pub growth_interval: i64,
    found_inf: Option<Tensor>,
    skipped: u64,
}

impl GradScaler {
    /// A scaler for the trainable variables of `vs`, starting at a scale of 2^16.
    pub fn new(vs: &nn::VarStore) -> GradScaler {
        GradScaler::with_scale(vs, 65536.0)
    }

    /// A scaler starting at `init_scale`.
    pub fn with_scale(vs: &nn::VarStore, init_scale: f64) -> GradScaler {
        let device = vs.device();
        GradScaler {
            variables: vs.variables_.clone(),
            scale: Tensor::from_slice(&[init_scale as f32]).to_device(device),
            growth_tracker: Tensor::from_slice(&[0i32]).to_device(device),
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            found_inf: None,
            skipped: 0,
        }
    }

    /// The current scale.
    pub fn scale_value(&self) -> f64 {
        self.scale.double_value(&[])
    }

    /// Steps skipped so far because a gradient held inf/nan.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    /// `loss` times the scale (call `.backward()` on it).
    pub fn scale(&self, loss: &Tensor) -> Tensor {
        loss * self.scale.to_device(loss.device()).to_kind(loss.kind())
    }

    /// Unscales the gradients in place and notes whether any is inf/nan. Called by [`step`]
    /// when not called before (call it yourself before clipping gradients).
    ///
    /// [`step`]: GradScaler::step
    pub fn unscale(&mut self) {
        if self.found_inf.is_some() {
            return;
        }
        // A VarStore keeps every variable on its one device, where the scale lives too.
        let mut found_inf = Tensor::zeros([1], (Kind::Float, self.scale.device()));
        let inv_scale = self.scale.reciprocal();
        let mut grads: Vec<Tensor> = crate::state::lock(&self.variables)
            .trainable_variables
            .iter()
            .map(|v| v.tensor.grad())
            .filter(|g| g.defined())
            .collect();
        if !grads.is_empty() {
            // One multi-tensor kernel instead of one per gradient (as PyTorch's GradScaler).
            let pointers: Vec<*mut C_tensor> = grads.iter_mut().map(|g| g.as_mut_ptr()).collect();
            ffi::call(|err, len| unsafe {
                tchmem_amp_unscale(
                    pointers.as_ptr(),
                    pointers.len(),
                    found_inf.as_mut_ptr(),
                    inv_scale.as_ptr(),
                    err,
                    len,
                )
            })
            .unwrap_or_else(|e| panic!("unscaling the gradients: {e}"));
        }
        self.found_inf = Some(found_inf);
    }

    /// Unscales the gradients, steps the optimizer unless one of them is inf/nan, and updates
    /// the scale. Returns whether the optimizer stepped. Marks the optimizer step
    /// ([`crate::phase::step`]; the caller marks its end).
    pub fn step(&mut self, opt: &mut impl Step) -> bool {
        crate::phase::step();
        self.unscale();
        let found_inf = self.found_inf.take().expect("unscale sets found_inf");
        let stepped = found_inf.double_value(&[0]) == 0.0;
        if stepped {
            opt.step();
        } else {
            self.skipped += 1;
        }
        let _ = self.scale.internal_amp_update_scale_(
            &self.growth_tracker,
            &found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        );
        stepped
    }

    /// `zero_grad`, backward of the scaled loss, then [`step`](GradScaler::step). Returns
    /// whether the optimizer stepped.
    pub fn backward_step(&mut self, opt: &mut impl Step, loss: &Tensor) -> bool {
        opt.zero_grad();
        self.scale(loss).backward();
        self.step(opt)
    }
}
