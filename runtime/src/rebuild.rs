//! A model that a rewrite rebuilds (`--checkpoint`, `--fused-loss`) is built on a VarStore of its
//! own; the notebook's weights go into it, and so does which of them train.

use tch::nn::VarStore;
use tch::TchError;

/// Copies the values of `notebook`'s variables into `rebuilt`'s of the same names, and whether
/// each takes gradients: a frozen backbone (`vs.freeze()`) stays frozen in the rebuilt model, so
/// that a trial neither makes its gradients nor lets the optimizer move it.
pub fn copy_store(rebuilt: &mut VarStore, notebook: &VarStore) -> Result<(), TchError> {
    rebuilt.copy(notebook)?;
    let theirs = notebook.variables();
    for (name, tensor) in rebuilt.variables() {
        if let Some(their) = theirs.get(&name) {
            if tensor.requires_grad() != their.requires_grad() {
                let _ = tensor.f_set_requires_grad(their.requires_grad())?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use tch::nn;
    use tch::Device;

    #[test]
    fn a_frozen_models_copy_is_frozen_with_its_values() {
        let mut notebook = nn::VarStore::new(Device::Cpu);
        let _frozen = nn::linear(notebook.root() / "backbone", 3, 2, Default::default());
        notebook.freeze();
        let _head = nn::linear(notebook.root() / "head", 2, 1, Default::default());
        let mut rebuilt = nn::VarStore::new(Device::Cpu);
        let _frozen = nn::linear(rebuilt.root() / "backbone", 3, 2, Default::default());
        let _head = nn::linear(rebuilt.root() / "head", 2, 1, Default::default());
        super::copy_store(&mut rebuilt, &notebook).unwrap();
        let ours = rebuilt.variables();
        for (name, theirs) in notebook.variables() {
            assert_eq!(
                ours[&name].requires_grad(),
                name.starts_with("head"),
                "{name}"
            );
            assert!(ours[&name].equal(&theirs), "{name}");
        }
    }
}
