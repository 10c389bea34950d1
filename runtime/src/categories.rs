//! The categories the runtime can name from what it knows: the watched tensors (exact) and the
//! optimizer state the phase markers measured.

use tchmem_wire::memory::{Category, CategoryName};

use crate::watch::Known;

/// Parameters, gradients and the input batch, from the watched tensors' bytes.
pub(crate) fn known(known: Known) -> Vec<Category> {
    let mut categories = Vec::new();
    if known.stores > 0 {
        categories.push(Category {
            name: CategoryName::Parameters,
            bytes: known.parameters,
            exact: true,
            how: format!(
                "sizes of the variables of {} watched VarStore(s)",
                known.stores
            ),
        });
        categories.push(Category {
            name: CategoryName::Gradients,
            bytes: known.gradients,
            exact: true,
            how: "sizes of the defined .grad() of trainable variables".into(),
        });
    }
    if known.input_batch > 0 {
        categories.push(Category {
            name: CategoryName::InputBatch,
            bytes: known.input_batch,
            exact: true,
            how: "size of the tensor given to tchmem::watch_batch".into(),
        });
    }
    categories
}

/// The optimizer-state category for `bytes`.
pub fn optimizer_state(bytes: u64) -> Category {
    Category {
        name: CategoryName::OptimizerState,
        bytes,
        exact: false,
        how: "growth of allocated bytes across the first optimizer step \
              (phase::step → phase::end), where optimizers create their state"
            .into(),
    }
}
