//! Models whose type cannot be written down, kept in variables that later cells use.
//!
//! tch code builds models in functions returning `impl ModuleT` (tch-rs's examples all do). A
//! notebook keeps every variable between cells, so it must name each one's type, and an `impl
//! Trait` cannot be named: the kernel then keeps `let model = gpt(..);` as one of these, which
//! is a module itself, so `xs.apply_t(&model, train)` and functions taking `&impl ModuleT` work
//! on it unchanged.

use tch::nn::{Module, ModuleT};
use tch::Tensor;

/// Any [`ModuleT`], boxed.
#[derive(Debug)]
pub struct DynModuleT(Box<dyn ModuleT>);

impl DynModuleT {
    /// Boxes `module`.
    pub fn new(module: impl ModuleT + 'static) -> DynModuleT {
        DynModuleT(Box::new(module))
    }
}

impl ModuleT for DynModuleT {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.0.forward_t(xs, train)
    }
}

/// Any [`Module`], boxed (a [`ModuleT`] too, as every module).
#[derive(Debug)]
pub struct DynModule(Box<dyn Module>);

impl DynModule {
    /// Boxes `module`.
    pub fn new(module: impl Module + 'static) -> DynModule {
        DynModule(Box::new(module))
    }
}

impl Module for DynModule {
    fn forward(&self, xs: &Tensor) -> Tensor {
        self.0.forward(xs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn::{self, OptimizerConfig};
    use tch::{Device, Kind};

    fn mlp(p: &nn::Path) -> impl ModuleT + use<> {
        let lin = nn::linear(p / "lin", 3, 2, Default::default());
        nn::func_t(move |xs, train| xs.apply(&lin).dropout(0.5, train))
    }

    #[test]
    fn boxed_models_forward_and_train_as_the_model_itself() {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = mlp(&vs.root());
        let xs = Tensor::ones([4, 3], (Kind::Float, Device::Cpu));
        let expected = model.forward_t(&xs, false);
        let boxed = DynModuleT::new(model);
        assert!(xs.apply_t(&boxed, false).equal(&expected));
        let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
        let loss = xs.apply_t(&boxed, true).sum(Kind::Float);
        opt.backward_step(&loss);
        assert!(
            !xs.apply_t(&boxed, false).equal(&expected),
            "the step reached the weights"
        );

        let linear = DynModule::new(nn::linear(vs.root() / "other", 3, 1, Default::default()));
        assert_eq!(xs.apply(&linear).size(), [4, 1]);
        assert_eq!(xs.apply_t(&linear, true).size(), [4, 1]);
    }
}
