//! Models of earlier cells: rebuilt for `--checkpoint` (a `let` that builds an `nn::seq()` or
//! `nn::seq_t()`, with the functions it calls, on a store of its own that the notebook's weights
//! are copied into), and the model `%memestimate` counts before any loop.

use super::definitions::{Defined, Definition, Live};
use super::library::{self, ModuleSources};
use super::library_item;
use super::{Brought, EarlierCell, Rebuilt, UnknownOptimizer};
use crate::rewrite::checkpoint;
use tchmem_wire::estimate::OptimizerRule;

/// The model `name` rebuilt, when its live definition is a `let` that builds it (itself or
/// through functions of earlier cells) from one VarStore of an earlier cell, and, when `seq`,
/// builds an `nn::seq()` or `nn::seq_t()` on the way: a block that builds it again, with those
/// functions, on a new store, and copies the notebook's weights into it.
///
/// `used` are the names the cell uses: when another value of them is built on the same store
/// (a `linear` beside an `lstm`), the model is in parts and the new store would hold only this
/// one (the optimizer rebuilt on it would train the rest no more): no rebuild.
pub(super) fn rebuilt_model(
    name: &str,
    live: &Live,
    seq: bool,
    used: &[String],
) -> Option<Rebuilt> {
    let functions = &live.functions;
    let (run, definition, pattern, init) = model_let(name, live)?;
    let mut reached = reached_functions(definition, live);
    let store = single_store(name, definition, live, used)?;
    if seq && !seq_in(definition, &reached, live) {
        return None;
    }
    // In the order they were defined.
    reached.sort_by_key(|f| (functions[*f].0, functions[*f].1));
    let items: String = reached
        .iter()
        .map(|f| format!("{}\n", functions[*f].2.code))
        .collect();
    Some(Rebuilt {
        name: name.to_string(),
        run: *run,
        what: Brought::Model,
        code: on_a_store_of_its_own(pattern, store, &items, init),
        library: None,
    })
}

/// The model `name` rebuilt from its library's source, when its live definition is a `let` that
/// calls a function of a dependency's module (`resnet::resnet18(&vs.root(), 10)`) with one
/// VarStore of an earlier cell, and that module builds an `nn::seq()` or `nn::seq_t()`: the
/// module goes in front of the call as an item of the block (see [`super::library`]).
pub(super) fn rebuilt_library_model(
    name: &str,
    live: &Live,
    used: &[String],
    sources: ModuleSources<'_>,
) -> Option<Rebuilt> {
    let (run, definition, pattern, init) = model_let(name, live)?;
    let call: syn::Expr = syn::parse_str(init).ok()?;
    let syn::Expr::Call(call) = &call else {
        return None;
    };
    let syn::Expr::Path(func) = &*call.func else {
        return None;
    };
    let written: Vec<String> = func
        .path
        .segments
        .iter()
        .map(|s| s.ident.to_string())
        .collect();
    let full = library::resolve(&written, &live.imports)?;
    let (function, module) = full.split_last()?;
    if live.functions.contains_key(function) && written.len() == 1 {
        return None;
    }
    let source = sources(module)?;
    let module_name = library::module_name(module);
    let Some(items) = library_item::reached_items(module, &source.code, function) else {
        tracing::info!(
            "{}: no function {function} could be taken from it",
            source.file
        );
        return None;
    };
    let builds_seq = items
        .iter()
        .any(|item| checkpoint::builds_seq(&syn::Stmt::Item(item.clone())));
    if !builds_seq {
        return None;
    }
    let store = single_store(name, definition, live, used)?;
    // The call as written, its function named in the module brought in.
    let (_, arguments) = init.split_once('(')?;
    let init = format!("{module_name}::{function}({arguments}");
    Some(Rebuilt {
        name: name.to_string(),
        run: *run,
        what: Brought::Model,
        code: on_a_store_of_its_own(
            pattern,
            store,
            &format!("{}\n", library_item::as_module(&module_name, items)),
            &init,
        ),
        library: Some(format!("`{}` ({})", full.join("::"), source.file)),
    })
}

/// The functions of earlier cells that `definition` calls, and those they call.
fn reached_functions<'a>(definition: &'a Definition, live: &'a Live) -> Vec<&'a str> {
    let mut reached: Vec<&str> = Vec::new();
    let mut todo: Vec<&str> = definition.uses.iter().map(String::as_str).collect();
    while let Some(next) = todo.pop() {
        if let Some((_, _, function)) = live.functions.get(next) {
            if !reached.contains(&next) {
                reached.push(next);
                todo.extend(function.uses.iter().map(String::as_str));
            }
        }
    }
    reached
}

/// Whether `definition` builds an `nn::seq()`/`nn::seq_t()`, itself or in the functions of
/// earlier cells it calls: what `--checkpoint` rewrites.
fn builds_seq(definition: &Definition, live: &Live) -> bool {
    seq_in(definition, &reached_functions(definition, live), live)
}

/// [`builds_seq`], with the functions `definition` reaches already followed.
fn seq_in(definition: &Definition, reached: &[&str], live: &Live) -> bool {
    definition.has_seq || reached.iter().any(|f| live.functions[*f].2.has_seq)
}

/// The live `let {pattern} = {init}` of `name` that may build a model (not a store, an
/// optimizer or a batch size), with its cell.
fn model_let<'a>(
    name: &str,
    live: &'a Live,
) -> Option<(&'a usize, &'a Definition, &'a str, &'a str)> {
    let (run, _, definition) = live.values.get(name)?;
    match &definition.local {
        Some((pattern, Some(init))) if definition.what.is_none() => {
            Some((run, definition, pattern, init))
        }
        _ => None,
    }
}

/// The one VarStore of an earlier cell that `definition` (of `name`) builds on, when the cell
/// uses no other value built on it (a `linear` beside an `lstm`: the model is in parts, and a
/// new store would hold only this one, so the optimizer rebuilt on it would train the rest no
/// more).
fn single_store<'a>(
    name: &str,
    definition: &'a Definition,
    live: &Live,
    used: &[String],
) -> Option<&'a String> {
    match store_and_parts(name, definition, live, used)? {
        (store, others) if others.is_empty() => Some(store),
        _ => None,
    }
}

/// The one VarStore of an earlier cell that `definition` (of `name`) builds on, and the other
/// values the cell uses that are built on a path of it (the model's other parts: a fine-tuned
/// backbone's new head; not `vs.device()`).
fn store_and_parts<'a>(
    name: &str,
    definition: &'a Definition,
    live: &Live,
    used: &[String],
) -> Option<(&'a String, Vec<String>)> {
    let stores: Vec<&String> = definition
        .uses
        .iter()
        .filter(|used| {
            live.values
                .get(*used)
                .is_some_and(|(_, _, d)| matches!(d.what, Some(Defined::VarStore)))
        })
        .collect();
    let [store] = stores.as_slice() else {
        return None;
    };
    let mut others: Vec<String> = used
        .iter()
        .filter(|other| {
            *other != name
                && live.values.get(*other).is_some_and(|(_, _, d)| {
                    let on_a_path = d
                        .local
                        .as_ref()
                        .and_then(|(_, init)| init.as_deref())
                        .is_some_and(|init| init.contains(".root()"));
                    d.what.is_none() && on_a_path && d.uses.contains(*store)
                })
        })
        .cloned()
        .collect();
    others.sort();
    Some((*store, others))
}

/// The `let {pattern} = {init}` of an earlier cell, with `items` (the functions or module it
/// calls) in front of it, run on a new store: the model's code sees only it (`store` inside the
/// block), the notebook's weights are copied into it, then it takes the store's name.
fn on_a_store_of_its_own(pattern: &str, store: &str, items: &str, init: &str) -> String {
    format!(
        "let mut __tchmem_store = tch::nn::VarStore::new({store}.device());\n\
         let {pattern} = {{\n\
         let {store} = &__tchmem_store;\n\
         {items}{init}\n\
         }};\n\
         tchmem::rebuild::copy_store(&mut __tchmem_store, &{store}).expect(\"tchmem: copying \
         the notebook's weights into the rebuilt model\");\n\
         let mut {store} = __tchmem_store;"
    )
}

/// What an earlier cell's `let` built, when it is a model `--checkpoint` cannot rebuild: its
/// refusal then says why, and what would let it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelOrigin {
    /// The variable.
    pub name: String,
    /// The cell that built it.
    pub run: usize,
    pub kind: ModelKind,
}

/// What kind of model a [`ModelOrigin`] is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelKind {
    /// A value of a type implementing `Module`/`ModuleT` in an earlier cell (`Net::new(..)`):
    /// the type, and the cell of its impl.
    Struct { name: String, run: usize },
    /// A recurrent layer (`nn::lstm`, `nn::gru`): one call runs the whole sequence.
    Recurrent { function: String },
    /// Built by a function the notebook did not define (`resnet18` from `tch::vision`).
    Library { function: String },
    /// One of several parts the cell uses that are built on one store (a backbone and its new
    /// head on `vs`): a rebuilt model's store would hold this part only.
    InParts { store: String, others: Vec<String> },
}

/// What the `let` of `name` in an earlier cell built, when it is a model of a kind
/// [`ModelKind`] names.
pub(super) fn model_origin(name: &str, live: &Live, used: &[String]) -> Option<ModelOrigin> {
    let (run, _, definition) = live.values.get(name)?;
    let (_, Some(init)) = definition.local.as_ref()? else {
        return None;
    };
    let init: syn::Expr = syn::parse_str(init).ok()?;
    // What builds it: a function or a type's (`resnet::resnet18(..)`, `Net::new(..)`), a struct
    // literal, or none (an `nn::seq()` chain).
    let path = match crate::rewrite::syntax::strip_parens(&init) {
        syn::Expr::Call(call) => match &*call.func {
            syn::Expr::Path(func) if func.qself.is_none() => Some(func.path.clone()),
            _ => None,
        },
        syn::Expr::Struct(literal) => Some(literal.path.clone()),
        _ => None,
    };
    let segments: Vec<String> = path
        .iter()
        .flat_map(|path| path.segments.iter().map(|s| s.ident.to_string()))
        .collect();
    let last = segments.last().cloned().unwrap_or_default();
    // `Net::new(..)` or `Net { .. }`: the type is the segment before the function, or the path.
    let type_name = match &init {
        syn::Expr::Struct(_) => segments.last(),
        _ => segments.iter().rev().nth(1),
    };
    // A function of a module path (`resnet::resnet18`), not of a type (`Tensor::zeros`), nor
    // one of tch's single layers (`nn::linear`).
    let library = !segments.is_empty()
        && segments.iter().all(|s| s.starts_with(char::is_lowercase))
        && !segments.iter().any(|s| s == "nn")
        && !live.functions.contains_key(&last)
        && !definition.has_seq;
    let kind = if let Some((ty, impl_run)) =
        type_name.and_then(|ty| live.module_types.get(ty).map(|run| (ty, *run)))
    {
        ModelKind::Struct {
            name: ty.clone(),
            run: impl_run,
        }
    } else if matches!(last.as_str(), "lstm" | "gru") {
        ModelKind::Recurrent { function: last }
    } else if let Some((store, others)) = store_and_parts(name, definition, live, used)
        .filter(|(_, others)| !others.is_empty() && (library || builds_seq(definition, live)))
    {
        // A model --checkpoint would rebuild, were it alone on its store.
        ModelKind::InParts {
            store: store.clone(),
            others,
        }
    } else if library {
        ModelKind::Library { function: last }
    } else {
        return None;
    };
    Some(ModelOrigin {
        name: name.to_string(),
        run: *run,
        kind,
    })
}

/// The model the notebook holds now, as earlier cells made it (what `%memestimate` counts
/// before any training loop ran).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveModel {
    /// Its VarStores and the cells that made them: those its optimizers are built on (a GAN's
    /// two), else every live one.
    pub stores: Vec<(String, usize)>,
    /// Its optimizers: those the cell of the newest optimizer built (the newest on each store),
    /// in the order they were built.
    pub optimizers: Vec<LiveOptimizer>,
}

/// An optimizer an earlier cell built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveOptimizer {
    /// Its variable.
    pub name: String,
    /// The cell that built it.
    pub run: usize,
    /// The VarStore it is built on.
    pub store: String,
    /// Its type's name and state rule, when the kernel knows them.
    pub rule: Option<(String, OptimizerRule)>,
    /// When its type is one tchmem does not know (the notebook's `SparseAdam`): how to name it.
    pub unknown: Option<UnknownOptimizer>,
}

/// The model the earlier cells left, `None` when no VarStore of theirs is live.
pub fn live_model(earlier: &[EarlierCell]) -> Option<LiveModel> {
    let mut live = Live::of(earlier);
    live.mark_unknown_optimizers(&live.optimizers_of_the_notebook());
    let live = live.values;
    let mut stores: Vec<(String, usize)> = live
        .iter()
        .filter(|(_, (_, _, d))| matches!(d.what, Some(Defined::VarStore)))
        .map(|(name, (run, _, _))| (name.clone(), *run))
        .collect();
    stores.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
    if stores.is_empty() {
        return None;
    }
    // Every optimizer built on a live store, as the cells built them; the newest on a store is
    // the one that trains it.
    let mut built: Vec<((usize, usize), LiveOptimizer)> = live
        .iter()
        .filter_map(|(name, (run, index, d))| {
            let built = d.optimizer.as_ref()?;
            let store = built.store.as_ref()?;
            stores.iter().any(|(s, _)| s == store).then(|| {
                let optimizer = LiveOptimizer {
                    name: name.clone(),
                    run: *run,
                    store: store.clone(),
                    rule: built.rule.clone(),
                    unknown: built.unknown_optimizer(name, *run),
                };
                ((*run, *index), optimizer)
            })
        })
        .collect();
    built.sort_by_key(|(at, _)| *at);
    // Those the newest optimizer's cell built: one cell building several trains them together
    // (the GAN's two); an optimizer of an earlier cell belongs to another experiment.
    let newest_cell = built.last().map(|((run, _), _)| *run);
    let mut optimizers: Vec<LiveOptimizer> = Vec::new();
    for (_, optimizer) in built.into_iter().rev() {
        if Some(optimizer.run) == newest_cell
            && !optimizers
                .iter()
                .any(|newer| newer.store == optimizer.store)
        {
            optimizers.insert(0, optimizer);
        }
    }
    if !optimizers.is_empty() {
        stores.retain(|(s, _)| optimizers.iter().any(|o| &o.store == s));
    }
    Some(LiveModel { stores, optimizers })
}

#[cfg(test)]
mod tests {
    use super::super::tests::{cells, MODEL};
    use super::super::{assemble, Brought, ModelKind, Wanted};
    use super::*;

    #[test]
    fn a_seq_model_of_earlier_cells_is_rebuilt_with_its_functions_on_a_store_of_its_own() {
        // mnist_nn's cells: the function, then the store, model and optimizer.
        let earlier = cells(&[
            "const HIDDEN: i64 = 128;\nfn net(vs: &nn::Path) -> impl Module {\n    \
             nn::seq().add(nn::linear(vs / \"l\", 784, HIDDEN, Default::default()))\n}\n\
             fn unrelated() -> i64 { 1 }",
            "let vs = nn::VarStore::new(Device::Cpu);\nlet net = net(&vs.root());\n\
             let mut opt = nn::Adam::default().build(&vs, 1e-3)?;",
        ]);
        let cell = "for _ in 0..2 {\n    let loss = net.forward(&xs).mean(Kind::Float);\n    \
                    opt.backward_step(&loss);\n}";
        let wanted = Wanted {
            batch: false,
            optimizer: false,
            model: true,
            head: false,
        };
        let assembled = assemble(cell, &earlier, wanted);
        let kinds: Vec<Brought> = assembled.rebuilt.iter().map(|r| r.what).collect();
        // The optimizer comes with the model (it must step the new store's variables).
        assert_eq!(kinds, [Brought::Model, Brought::Optimizer]);
        let code = &assembled.code;
        assert!(
            code.starts_with(
                "// from cell [2]\nlet mut __tchmem_store = tch::nn::VarStore::new(vs.device());\n\
                 let net = {\nlet vs = &__tchmem_store;\nfn net(vs: &nn::Path) -> impl Module {"
            ),
            "{code}"
        );
        assert!(!code.contains("fn unrelated"), "{code}");
        assert!(
            code.contains(
                "net(&vs.root())\n};\ntchmem::rebuild::copy_store(&mut __tchmem_store, &vs)\
                 .expect(\"tchmem: copying the notebook's weights into the rebuilt model\");\n\
                 let mut vs = __tchmem_store;\n"
            ),
            "{code}"
        );
        assert!(code.contains("let mut opt = nn::Adam::default().build(&vs, 1e-3)?;\nfor _ in"));
        assert_eq!(assembled.var_stores, ["vs"]);
        // Not without --checkpoint, and not for a model that is not a seq.
        assert!(assemble(
            cell,
            &earlier,
            Wanted {
                model: false,
                ..wanted
            }
        )
        .rebuilt
        .is_empty());
        let structs =
            cells(&["let vs = nn::VarStore::new(Device::Cpu);\nlet net = Net::new(&vs.root());"]);
        assert!(assemble(cell, &structs, wanted).rebuilt.is_empty());
    }

    #[test]
    fn models_that_cannot_be_rebuilt_say_what_they_are() {
        // mnist_conv's, char_rnn's and a tch::vision model's cells.
        let earlier = cells(&[
            "struct Net { fc: nn::Linear }\nimpl nn::ModuleT for Net {\n    fn forward_t(&self, \
             xs: &Tensor, _train: bool) -> Tensor { xs.apply(&self.fc) }\n}\n\
             struct Vae { fc: nn::Linear }\nimpl Vae {\n    fn forward(&self, xs: &Tensor) -> \
             Tensor { xs.apply(&self.fc) }\n}\nstruct Config { n: i64 }\nimpl Config {\n    \
             fn new() -> Config { Config { n: 1 } }\n}",
            "let vs = nn::VarStore::new(Device::Cpu);\nlet net = Net::new(&vs.root());\n\
             let lstm = nn::lstm(vs.root(), 65, 256, Default::default());\n\
             let rvs = nn::VarStore::new(Device::Cpu);\n\
             let resnet = tch::vision::resnet::resnet18(&rvs.root(), 10);\n\
             let zeros = Tensor::zeros([2], (Kind::Float, Device::Cpu));\n\
             let lin = nn::linear(vs.root(), 2, 2, Default::default());\n\
             let vae = Vae::new(&vs.root());\nlet config = Config::new();",
        ]);
        let wanted = Wanted {
            batch: false,
            optimizer: false,
            model: true,
            head: false,
        };
        let cell = "let y = net.forward_t(&x, true) + lstm.seq(&x).0 + x.apply_t(&resnet, true) \
                    + zeros + x.apply(&lin) + vae.forward(&x) + config.n;";
        let mut models = assemble(cell, &earlier, wanted).known.models;
        models.sort_by(|a, b| a.name.cmp(&b.name));
        let kinds: Vec<(&str, &ModelKind)> =
            models.iter().map(|m| (m.name.as_str(), &m.kind)).collect();
        assert_eq!(
            kinds,
            [
                (
                    "lstm",
                    &ModelKind::Recurrent {
                        function: "lstm".into()
                    }
                ),
                (
                    "net",
                    &ModelKind::Struct {
                        name: "Net".into(),
                        run: 1
                    }
                ),
                (
                    "resnet",
                    &ModelKind::Library {
                        function: "resnet18".into()
                    }
                ),
                (
                    "vae",
                    &ModelKind::Struct {
                        name: "Vae".into(),
                        run: 1
                    }
                ),
            ]
        );
        assert!(models.iter().all(|m| m.run == 2));
        // Only for --checkpoint.
        assert!(assemble(cell, &earlier, Wanted::TRIAL)
            .known
            .models
            .is_empty());
    }

    #[test]
    fn the_live_model_is_the_store_its_optimizer_is_built_on() {
        let model = live_model(&cells(&[
            "let critic = nn::VarStore::new(Device::Cpu);",
            MODEL,
        ]))
        .unwrap();
        assert_eq!(model.stores, vec![("vs".to_string(), 2)]);
        let [optimizer] = model.optimizers.as_slice() else {
            panic!("{:?}", model.optimizers)
        };
        assert_eq!((optimizer.name.as_str(), optimizer.run), ("opt", 2));
        assert_eq!(optimizer.store, "vs");
        assert_eq!(optimizer.rule, Some(("Adam".into(), OptimizerRule::Adam)));
        // No optimizer yet: every live store.
        let model = live_model(&cells(&[
            "let critic = nn::VarStore::new(Device::Cpu);",
            "let vs = nn::VarStore::new(Device::Cpu);",
        ]))
        .unwrap();
        assert_eq!(model.stores.len(), 2);
        assert!(model.optimizers.is_empty());
        assert_eq!(live_model(&cells(&["let x = 1;"])), None);
        // tch-rs's GAN: two stores, each with its Adam; an older optimizer on one is replaced.
        let gan = [
            "let mut generator_vs = nn::VarStore::new(device);\n\
             let mut opt_g = nn::Sgd::default().build(&generator_vs, 0.1)?;",
            "let mut opt_g = nn::adam(0.5, 0.999, 0.).build(&generator_vs, LEARNING_RATE)?;\n\
             let mut discriminator_vs = nn::VarStore::new(device);\n\
             let mut opt_d = nn::adam(0.5, 0.999, 0.).build(&discriminator_vs, LEARNING_RATE)?;\n\
             let unused_vs = nn::VarStore::new(device);",
        ];
        let model = live_model(&cells(&gan)).unwrap();
        let stores: Vec<&str> = model.stores.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(stores, ["generator_vs", "discriminator_vs"]);
        let optimizers: Vec<(&str, &str, usize)> = model
            .optimizers
            .iter()
            .map(|o| (o.name.as_str(), o.store.as_str(), o.run))
            .collect();
        assert_eq!(
            optimizers,
            [
                ("opt_g", "generator_vs", 2),
                ("opt_d", "discriminator_vs", 2)
            ]
        );
        // A model and optimizer built in a later cell are another experiment: they alone count.
        let later = [gan[0], gan[1], MODEL];
        let model = live_model(&cells(&later)).unwrap();
        assert_eq!(model.stores, vec![("vs".to_string(), 3)]);
        assert_eq!(model.optimizers.len(), 1);
    }
}
