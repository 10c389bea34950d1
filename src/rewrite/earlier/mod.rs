//! What a training cell takes from the cells before it.
//!
//! The kernel keeps the code of every cell that ran ([`EarlierCell`]). A magic that runs a cell
//! in trials (`--compare`, `%memestimate`, `%memfit`, `--fit`, the OOM diagnosis) follows the
//! names the cell uses but does not bind back to the newest cell that defined them, and brings
//! in front of the cell what a trial must have in its own code ([`assemble`]):
//! - the batch size (`const BATCH_SIZE: i64 = 64;`, `let batch_size = 64;`), so that the trials
//!   can vary it;
//! - the optimizer (`let mut opt = nn::Adam::default().build(&vs, 1e-3)?;`), so that a trial
//!   steps a fresh one (the user's keeps its state) and `--optimizer` can swap it;
//! - for `--checkpoint`, a model built with `nn::seq()`/`nn::seq_t()` by earlier cells, rebuilt
//!   with the functions that build it, or by a library's function, rebuilt from its source.
//!
//! It also names the VarStores the cell uses that were made earlier: a trial keeps their
//! tensors and puts them back after it (the runtime's `tchmem::keep`), so that the user's model
//! is the same after the magic as before it, and both sides of `--compare` start from it.
//!
//! The modules: `definitions` reads the top-level definitions of the earlier cells (the live
//! one of each name), `model` rebuilds a model of earlier cells for `--checkpoint` and finds the
//! model `%memestimate` counts before any loop; `library` follows a model built by a library's
//! function to its module (through the cells' imports), and `library_item` makes that module's
//! source an item of the trial's code.

mod definitions;
mod library;
mod library_item;
mod model;

use std::collections::HashSet;

use tchmem_wire::estimate::OptimizerRule;

use super::{Change, Refusal};
use definitions::{all_names, free_names, Defined, Live};

pub use definitions::UnknownType;

pub(super) use definitions::names_in as identifiers;
use model::{model_origin, rebuilt_library_model, rebuilt_model};

pub use library::{LibraryModule, ModuleSources};

pub use model::{live_model, LiveModel, LiveOptimizer, ModelKind, ModelOrigin};

/// A cell that ran before, as the kernel kept it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EarlierCell {
    /// Its number among the session's cells (as the memory records count them).
    pub run: usize,
    /// Its code, magic lines left out.
    pub code: String,
}

/// What a definition brought from an earlier cell is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Brought {
    /// An integer bound to a name with "batch" in it.
    BatchSize,
    /// An optimizer built from a VarStore.
    Optimizer,
    /// A model built with `nn::seq()`/`nn::seq_t()`, rebuilt with the functions that build it on
    /// a store of its own, the notebook's weights copied in.
    Model,
}

/// A definition brought in front of a cell from an earlier one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rebuilt {
    /// The name it binds.
    pub name: String,
    /// The cell it was defined in.
    pub run: usize,
    pub what: Brought,
    /// Its statement, as written there.
    pub code: String,
    /// For a model built by a library's function: the function and the file its module was
    /// brought in from (`` `tch::vision::resnet::resnet18` (tch-0.24.0/src/vision/resnet.rs) ``).
    pub library: Option<String>,
}

/// A function of an earlier cell that the cell calls, directly or through another: the rewriter
/// reads it where what the cell does depends on it (an op that autocast refuses in a loss
/// function, say).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EarlierFn {
    /// Its name.
    pub name: String,
    /// The cell it was defined in.
    pub run: usize,
    /// Its code, as written there.
    pub code: String,
}

/// What a cell needs brought in from earlier cells for a given use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wanted {
    /// Batch-size bindings (trials vary them).
    pub batch: bool,
    /// The optimizer (trials step a fresh one; `--optimizer` swaps it).
    pub optimizer: bool,
    /// The model, when it is built with `nn::seq()`/`nn::seq_t()` by earlier cells
    /// (`--checkpoint` rewrites those builders): rebuilt from its cells on a store of its own.
    pub model: bool,
    /// The model, however earlier cells build it (`--fused-loss` marks its head where it is
    /// built), when `model` rebuilt none.
    pub head: bool,
}

impl Wanted {
    /// What a trial needs: the batch and a fresh optimizer.
    pub const TRIAL: Wanted = Wanted {
        batch: true,
        optimizer: true,
        model: false,
        head: false,
    };
}

/// A cell with what it takes from earlier cells in front of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assembled {
    /// The definitions brought in, then the cell.
    pub code: String,
    /// Lines of `code` before the cell's first line.
    pub prelude_lines: usize,
    /// What was brought in, in the order written.
    pub rebuilt: Vec<Rebuilt>,
    /// VarStores the cell uses that earlier cells made (`vs`): a trial keeps and restores them.
    pub var_stores: Vec<String>,
    /// What else the rewriter may read of the earlier cells.
    pub known: Known,
}

/// What the rewriter may read of the earlier cells besides the code brought in front of a cell.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Known {
    /// The functions of earlier cells the cell calls (not brought in: they are still defined).
    pub functions: Vec<EarlierFn>,
    /// The models of earlier cells the cell uses that `--checkpoint` cannot rebuild (when the
    /// model was wanted and none was rebuilt), for its refusal.
    pub models: Vec<ModelOrigin>,
    /// The variables of earlier cells the cell uses that hold an `nn::linear` (a head
    /// `--fused-loss` can take apart where the cell applies it).
    pub linears: Vec<String>,
    /// The optimizers brought in that the cell steps and whose type tchmem does not know (the
    /// notebook's own `SparseAdam`, a crate's): rewrites that change tch's optimizers say so.
    pub unknown_optimizers: Vec<UnknownOptimizer>,
    /// The rules of optimizers brought in that a function of the notebook builds
    /// (`let mut opt = make_optimizer(&vs);`), with their names (`Adam`): the code brought in
    /// shows no build to read them from.
    pub rules_built_by_functions: Vec<(String, OptimizerRule)>,
}

/// An optimizer of a type tchmem does not know, built on a store by an earlier cell
/// (`let mut opt = SparseAdam::new(&vs, 5e-3, …);`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownOptimizer {
    /// Its variable.
    pub name: String,
    /// The cell that built it.
    pub run: usize,
    /// The VarStore it is built on.
    pub store: String,
    pub kind: UnknownType,
}

impl UnknownOptimizer {
    /// How a message names it: "`opt` (a `SparseAdam`, built in cell [4])".
    pub fn described(&self) -> String {
        format!(
            "`{}` (a `{}`, built in cell [{}])",
            self.name, self.kind.name, self.run
        )
    }

    /// What it is: "one the notebook wrote", or one of a crate's type.
    pub fn origin(&self) -> &'static str {
        if self.kind.in_notebook {
            "one the notebook wrote"
        } else {
            "one of a type tchmem does not know"
        }
    }

    /// How an estimate's heading names it in place of a rule: "SparseAdam (the notebook's)".
    pub fn heading(&self) -> String {
        let whose = if self.kind.in_notebook {
            "the notebook's"
        } else {
            "a type tchmem does not know"
        };
        format!("{} ({whose})", self.kind.name)
    }
}

impl Assembled {
    /// `refusal` (about `code`) in the cell's own terms: a line of the cell is moved up by the
    /// prelude; a line of the prelude is named by the cell it came from.
    pub fn in_cell_terms(&self, refusal: Refusal) -> Refusal {
        let prelude = self.prelude_lines;
        match refusal.line {
            Some(line) if line > prelude => refusal.moved(|line| line.checked_sub(prelude)),
            Some(line) => {
                let from = self.rebuilt_at(line).map_or(String::new(), |rebuilt| {
                    format!(" (`{}`, brought from cell [{}])", rebuilt.name, rebuilt.run)
                });
                Refusal::new(format!("{}{from}", refusal.message), None)
            }
            None => refusal,
        }
    }

    /// The definition on line `line` of the prelude.
    fn rebuilt_at(&self, line: usize) -> Option<&Rebuilt> {
        let mut next = 1;
        for rebuilt in &self.rebuilt {
            // A comment line, then the statement.
            let end = next + 1 + rebuilt.code.lines().count();
            if line < end {
                return Some(rebuilt);
            }
            next = end;
        }
        None
    }

    /// One line per definition brought in, for the user ("`opt` rebuilt from cell [3]").
    pub fn notes(&self) -> Vec<String> {
        self.rebuilt
            .iter()
            .map(|rebuilt| match rebuilt.what {
                Brought::BatchSize => format!(
                    "`{}` is defined in cell [{}]: brought in front of the cell, so that the \
                     batch can be varied",
                    rebuilt.name, rebuilt.run
                ),
                Brought::Optimizer => format!(
                    "the optimizer `{}` is built in cell [{}]: rebuilt here from that cell's \
                     statement",
                    rebuilt.name, rebuilt.run
                ),
                Brought::Model => format!(
                    "the model `{}` is built in cell [{}] by {}: rebuilt here with {}, on a \
                     VarStore of its own into which the notebook's weights are copied (the \
                     rebuilt model, its store and the optimizer replace the notebook's where \
                     the cell's variables are kept)",
                    rebuilt.name,
                    rebuilt.run,
                    rebuilt
                        .library
                        .as_deref()
                        .unwrap_or("functions of earlier cells"),
                    if rebuilt.library.is_some() {
                        "its module's source as a module of the trial's code (the same \
                         variables under the same names)"
                    } else {
                        "them"
                    }
                ),
            })
            .collect()
    }

    /// A rewrite's `changes` (lines of `code`) in the cell's terms, after the notes on what
    /// was brought in: a change to a line of the cell moves up by the prelude; one to a
    /// statement brought in names the cell it came from.
    pub fn cell_changes(&self, changes: Vec<Change>) -> Vec<Change> {
        let mut out: Vec<Change> = self.notes().into_iter().map(Change::general).collect();
        for change in changes {
            let lines = change.lines;
            let moved = match lines {
                Some((first, last)) if first > self.prelude_lines => Change::over(
                    (first - self.prelude_lines, last - self.prelude_lines),
                    change.what,
                ),
                Some((first, _)) => match self.rebuilt_at(first) {
                    Some(rebuilt) => Change::general(format!(
                        "`{}` (from cell [{}]): {}",
                        rebuilt.name, rebuilt.run, change.what
                    )),
                    None => Change::general(change.what),
                },
                None => change,
            };
            // Builders brought in from one definition say the same once.
            if !out.contains(&moved) {
                out.push(moved);
            }
        }
        out
    }
}

/// `cell` with the definitions `wanted` from `earlier` cells (oldest first) in front of it, no
/// library's sources at hand (the rewriter's tests).
#[cfg(test)]
pub fn assemble(cell: &str, earlier: &[EarlierCell], wanted: Wanted) -> Assembled {
    let run = earlier.last().map_or(1, |last| last.run + 1);
    assemble_with(cell, run, earlier, wanted, &|_| None)
}

/// `cell` (the session's cell number `run`) with the definitions `wanted` from `earlier` cells
/// (oldest first) in front of it; a model built by a library's function may be rebuilt from its
/// module's source, read by `sources`.
pub fn assemble_with(
    cell: &str,
    run: usize,
    earlier: &[EarlierCell],
    wanted: Wanted,
    sources: ModuleSources<'_>,
) -> Assembled {
    let mut all = Live::of(earlier);
    // An optimizer of a type tchmem does not know is brought in only when the cell steps it.
    all.mark_unknown_optimizers(&stepped(cell));
    let live = &all.values;
    let direct = free_names(cell);
    let model = if wanted.model {
        direct
            .iter()
            .find_map(|name| rebuilt_model(name, &all, true, &direct))
            .or_else(|| {
                direct
                    .iter()
                    .find_map(|name| rebuilt_library_model(name, &all, &direct, sources))
            })
    } else {
        None
    };
    let linears: Vec<String> = direct
        .iter()
        .filter(|name| live.get(*name).is_some_and(|(_, _, d)| d.makes_linear()))
        .cloned()
        .collect();
    let model = match model {
        // Only a model whose output the loss takes (a head the cell applies itself needs none).
        None if wanted.head => {
            let under_loss = crate::rewrite::models_under_loss(cell);
            direct
                .iter()
                .filter(|name| under_loss.contains(*name) && !linears.contains(name))
                .find_map(|name| rebuilt_model(name, &all, false, &direct))
        }
        model => model,
    };
    let models = match &model {
        None if wanted.model => direct
            .iter()
            .filter_map(|name| model_origin(name, &all, &direct))
            .collect(),
        _ => Vec::new(),
    };
    // A rebuilt model has new variables: the optimizer must be built on them.
    let wanted_optimizer = wanted.optimizer || model.is_some();
    let mut rebuilt: Vec<(usize, usize, Rebuilt)> = Vec::new();
    for name in &direct {
        let Some((run, index, definition)) = live.get(name) else {
            continue;
        };
        let take = match definition.what {
            Some(Defined::Brought(Brought::BatchSize)) => wanted.batch,
            Some(Defined::Brought(Brought::Optimizer)) => wanted_optimizer,
            _ => false,
        };
        if let (true, Some(Defined::Brought(what))) = (take, &definition.what) {
            let rebuilt_one = Rebuilt {
                name: name.clone(),
                run: *run,
                what: *what,
                code: definition.code.clone(),
                library: None,
            };
            rebuilt.push((*run, *index, rebuilt_one));
        }
    }
    // As the cells ran; a rebuilt model first (the optimizer is then built on its store).
    rebuilt.sort_by_key(|(run, index, _)| (*run, *index));
    let rebuilt: Vec<Rebuilt> = model
        .into_iter()
        .chain(rebuilt.into_iter().map(|(_, _, r)| r))
        .collect();

    // The VarStores behind what the cell uses, followed through earlier definitions (`net`
    // built from `vs.root()` trains `vs`).
    let mut reached: HashSet<String> = HashSet::new();
    let mut todo: Vec<String> = direct;
    for rebuilt in &rebuilt {
        todo.extend(live[&rebuilt.name].2.uses.iter().cloned());
    }
    while let Some(name) = todo.pop() {
        if let Some((_, _, definition)) = live.get(&name) {
            if reached.insert(name) {
                todo.extend(definition.uses.iter().cloned());
            }
        }
    }
    let mut var_stores: Vec<String> = reached
        .into_iter()
        .filter(|name| matches!(live[name].2.what, Some(Defined::VarStore)))
        .collect();
    var_stores.sort();
    let functions = called_functions(cell, &all);
    let in_the_cell = optimizers_built_in(cell, run, earlier);
    let unknown_optimizers = rebuilt
        .iter()
        .filter_map(|rebuilt| {
            live[&rebuilt.name]
                .2
                .optimizer
                .as_ref()?
                .unknown_optimizer(&rebuilt.name, rebuilt.run)
        })
        .chain(in_the_cell.unknown)
        .collect();
    let rules_built_by_functions = rebuilt
        .iter()
        .filter_map(|rebuilt| {
            let definition = &live.get(&rebuilt.name)?.2;
            definition.function_call.as_ref()?;
            definition.optimizer.as_ref()?.rule.clone()
        })
        .chain(in_the_cell.rules)
        .collect();

    let mut prelude = String::new();
    for rebuilt in &rebuilt {
        prelude.push_str(&format!(
            "// from cell [{}]\n{}\n",
            rebuilt.run, rebuilt.code
        ));
    }
    Assembled {
        prelude_lines: prelude.lines().count(),
        code: format!("{prelude}{cell}"),
        rebuilt,
        var_stores,
        known: Known {
            functions,
            models,
            linears,
            unknown_optimizers,
            rules_built_by_functions,
        },
    }
}

/// What the optimizers that `cell` (cell number `run`) builds itself and steps say of
/// themselves: those of a type tchmem does not know (`let mut opt = SparseAdam::new(&vs, …);`
/// above its loop, on a store of an earlier cell), named as one of an earlier cell is, and the
/// rules of those a function of the notebook builds (`let mut opt = make_optimizer(&vs);`),
/// which the cell's code does not show.
#[derive(Default)]
struct BuiltInTheCell {
    unknown: Vec<UnknownOptimizer>,
    rules: Vec<(String, OptimizerRule)>,
}

fn optimizers_built_in(cell: &str, run: usize, earlier: &[EarlierCell]) -> BuiltInTheCell {
    // A magic alone in its cell acts on an earlier cell's code: what that cell built is
    // brought in from it, as any earlier cell's is.
    if earlier.iter().any(|kept| kept.run == run) {
        return BuiltInTheCell::default();
    }
    let steps = stepped(cell);
    let this = EarlierCell {
        run,
        code: cell.to_string(),
    };
    // Most cells build no value they step by a call: one parse of the cell says so.
    let own = Live::of(std::slice::from_ref(&this));
    let by_a_call = |name: &String| {
        own.values.get(name).is_some_and(|(_, _, d)| {
            d.what.is_none() && (d.type_call.is_some() || d.function_call.is_some())
        })
    };
    if !steps.iter().any(by_a_call) {
        return BuiltInTheCell::default();
    }
    // The store, the optimizer's type and the function are the earlier cells'.
    let mut all = Live::of(&[earlier, std::slice::from_ref(&this)].concat());
    all.mark_unknown_optimizers(&steps);
    let mut built = BuiltInTheCell::default();
    for name in &steps {
        let Some((built_in, _, definition)) = all.values.get(name) else {
            continue;
        };
        let Some(optimizer) = definition.optimizer.as_ref().filter(|_| *built_in == run) else {
            continue;
        };
        built.unknown.extend(optimizer.unknown_optimizer(name, run));
        if definition.function_call.is_some() {
            built.rules.extend(optimizer.rule.clone());
        }
    }
    built
}

/// The optimizers `cell`'s training steps step (`opt` of `opt.step()` after a backward).
fn stepped(cell: &str) -> Vec<String> {
    let Ok(parsed) = super::cell::parse(cell) else {
        return Vec::new();
    };
    super::step::find_all(&super::tree::Tree::of(&parsed.block))
        .into_iter()
        .map(|step| step.opt.to_string())
        .collect()
}

/// The functions of `live` that `cell` calls, directly or through one another, by name.
fn called_functions(cell: &str, live: &Live) -> Vec<EarlierFn> {
    let mut reached: Vec<EarlierFn> = Vec::new();
    let mut todo = all_names(cell);
    while let Some(name) = todo.pop() {
        let Some((run, _, definition)) = live.functions.get(&name) else {
            continue;
        };
        if reached.iter().any(|f| f.name == name) {
            continue;
        }
        todo.extend(definition.uses.iter().cloned());
        reached.push(EarlierFn {
            name,
            run: *run,
            code: definition.code.clone(),
        });
    }
    reached.sort_by(|a, b| (a.run, &a.name).cmp(&(b.run, &b.name)));
    reached
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `assembled` brought in front of the cell: names and kinds.
    fn brought(assembled: &Assembled) -> Vec<(&str, Brought)> {
        assembled
            .rebuilt
            .iter()
            .map(|r| (r.name.as_str(), r.what))
            .collect()
    }

    pub(super) fn cells(codes: &[&str]) -> Vec<EarlierCell> {
        codes
            .iter()
            .enumerate()
            .map(|(i, code)| EarlierCell {
                run: i + 1,
                code: code.to_string(),
            })
            .collect()
    }

    pub(super) const MODEL: &str = "let vs = nn::VarStore::new(Device::cuda_if_available());\n\
                         let net = net(&vs.root());\n\
                         let mut opt = nn::Adam::default().build(&vs, 1e-3)?;";
    const LOOP: &str = "for (x, y) in m.train_iter(BATCH_SIZE).shuffle() {\n\
                        \x20   let loss = net.forward(&x).cross_entropy_for_logits(&y);\n\
                        \x20   opt.backward_step(&loss);\n}";

    #[test]
    fn the_functions_a_cell_calls_are_followed_through_one_another() {
        let earlier = cells(&[
            "fn bce(r: &Tensor, x: &Tensor) -> Tensor { r.binary_cross_entropy::<Tensor>(x, None, \
             Reduction::Sum) }\nfn unused() {}",
            "fn loss(r: &Tensor, x: &Tensor) -> Tensor { bce(r, x) }",
        ]);
        let assembled = assemble("let loss = loss(&a, &b);", &earlier, Wanted::TRIAL);
        let called: Vec<(&str, usize)> = assembled
            .known
            .functions
            .iter()
            .map(|f| (f.name.as_str(), f.run))
            .collect();
        assert_eq!(called, [("bce", 1), ("loss", 2)]);
        assert!(assembled.known.functions[0].code.starts_with("fn bce("));
    }

    #[test]
    fn the_optimizer_and_batch_const_come_from_their_cells_and_the_var_store_is_named() {
        let earlier = cells(&["const BATCH_SIZE: i64 = 256;\nconst LR: f64 = 1e-3;", MODEL]);
        let assembled = assemble(LOOP, &earlier, Wanted::TRIAL);
        assert_eq!(
            assembled.code,
            format!(
                "// from cell [1]\nconst BATCH_SIZE: i64 = 256;\n// from cell [2]\nlet mut opt = \
                 nn::Adam::default().build(&vs, 1e-3)?;\n{LOOP}"
            )
        );
        assert_eq!(assembled.prelude_lines, 4);
        assert_eq!(assembled.var_stores, vec!["vs".to_string()]);
        let notes = assembled.notes();
        assert!(
            notes[0].contains("`BATCH_SIZE` is defined in cell [1]"),
            "{notes:?}"
        );
        assert!(
            notes[1].contains("optimizer `opt` is built in cell [2]"),
            "{notes:?}"
        );
        // The batch is then found in the assembled code.
        let binding = super::super::batch::find(&assembled.code).unwrap();
        assert_eq!((binding.name.as_str(), binding.value), ("BATCH_SIZE", 256));

        // Refusals: a line of the cell moves up, a line of the prelude names its cell.
        let moved = assembled.in_cell_terms(Refusal::at(6, "here"));
        assert_eq!(moved.line, Some(2));
        // Lines the message names move with it, here and below a magic line.
        let named = Refusal::naming(6, (6, 7), "the forward pass and loss (lines 6–7) call it");
        let moved = assembled.in_cell_terms(named).shifted(1);
        assert_eq!(
            moved.to_string(),
            "line 3: the forward pass and loss (lines 3–4) call it"
        );
        let brought = assembled.in_cell_terms(Refusal::at(4, "no"));
        assert_eq!(
            (brought.line, brought.message.as_str()),
            (None, "no (`opt`, brought from cell [2])")
        );

        // A rewrite's changes in the cell's lines; one to a brought statement names its cell.
        let changes = assembled.cell_changes(vec![
            Change::at(4, "swapped"),
            Change::over((6, 7), "marked"),
            Change::general("note"),
        ]);
        let text: Vec<String> = changes.iter().map(ToString::to_string).collect();
        assert_eq!(text.len(), 5);
        assert_eq!(text[2], "`opt` (from cell [2]): swapped");
        assert_eq!(text[3..], ["lines 2–3: marked", "note"]);

        // Only what is wanted: a real run swapping nothing brings nothing.
        let none = assemble(
            LOOP,
            &earlier,
            Wanted {
                batch: false,
                optimizer: false,
                model: false,
                head: false,
            },
        );
        assert_eq!((none.code.as_str(), none.prelude_lines), (LOOP, 0));
    }

    /// tch-rs's custom-optimizer example, cut down: a type of the notebook's with a `step`.
    const WRITTEN: &str = "struct SparseAdam { vars: Arc<Mutex<Variables>>, lr: f64 }\n\
                           impl SparseAdam {\n\
                           \x20   pub fn new(vs: &VarStore, lr: f64) -> SparseAdam { todo!() }\n\
                           \x20   pub fn step(&mut self) {}\n\
                           \x20   pub fn zero_grad(&mut self) {}\n}\n\
                           fn net(vs: &nn::Path) -> impl Module {\n\
                           \x20   nn::seq().add(nn::linear(vs / \"l\", 784, 10, Default::default()))\n}";
    const WRITTEN_LOOP: &str = "for (x, y) in m.train_iter(BATCH_SIZE).shuffle() {\n\
                                \x20   let loss = net.forward(&x).cross_entropy_for_logits(&y);\n\
                                \x20   opt.zero_grad();\n    loss.backward();\n    opt.step();\n}";

    #[test]
    fn an_optimizer_the_notebook_wrote_is_built_afresh_and_leaves_the_model_whole() {
        let earlier = cells(&[
            WRITTEN,
            "let vs = nn::VarStore::new(Device::Cpu);\nlet net = net(&vs.root());\n\
             let force_sparse = false;\nlet mut opt = SparseAdam::new(&vs, 5e-3);",
        ]);
        // Trials step a fresh one: the notebook's keeps its state.
        let assembled = assemble(WRITTEN_LOOP, &earlier, Wanted::TRIAL);
        assert_eq!(brought(&assembled), [("opt", Brought::Optimizer)]);
        assert!(assembled
            .code
            .starts_with("// from cell [2]\nlet mut opt = SparseAdam::new(&vs, 5e-3);\nfor"));
        assert_eq!(
            assembled.known.unknown_optimizers,
            [UnknownOptimizer {
                name: "opt".into(),
                run: 2,
                store: "vs".into(),
                kind: UnknownType {
                    name: "SparseAdam".into(),
                    in_notebook: true
                }
            }]
        );
        // It is the optimizer, not a second model on the store: `--checkpoint` rebuilds the
        // model, and the optimizer on the new store after it.
        let wanted = Wanted {
            model: true,
            ..Wanted::TRIAL
        };
        let kinds: Vec<Brought> = assemble(WRITTEN_LOOP, &earlier, wanted)
            .rebuilt
            .iter()
            .map(|r| r.what)
            .collect();
        assert_eq!(kinds, [Brought::Model, Brought::Optimizer]);
        // Before any loop, %memestimate names it.
        let optimizer = &live_model(&earlier).unwrap().optimizers[0];
        assert_eq!(
            optimizer.unknown.as_ref().map(|t| t.kind.name.as_str()),
            Some("SparseAdam")
        );
        assert_eq!(optimizer.rule, None);
    }

    #[test]
    fn an_optimizer_the_notebook_wrote_built_in_the_training_cell_is_named_as_such() {
        let earlier = cells(&[
            WRITTEN,
            "let vs = nn::VarStore::new(Device::Cpu);\nlet net = net(&vs.root());",
        ]);
        let cell = format!("let mut opt = SparseAdam::new(&vs, 5e-3);\n{WRITTEN_LOOP}");
        let assembled = assemble(&cell, &earlier, Wanted::TRIAL);
        // The cell builds it itself: nothing is brought, and it is the cell's (number 3).
        assert!(assembled.rebuilt.is_empty(), "{:?}", assembled.rebuilt);
        assert_eq!(
            assembled.known.unknown_optimizers,
            [UnknownOptimizer {
                name: "opt".into(),
                run: 3,
                store: "vs".into(),
                kind: UnknownType {
                    name: "SparseAdam".into(),
                    in_notebook: true
                }
            }]
        );
        // A value the cell builds on the store but does not step is not one.
        let unstepped = format!("let mut ema = SparseAdam::new(&vs, 5e-3);\n{LOOP}");
        let known = assemble(&unstepped, &earlier, Wanted::TRIAL).known;
        assert!(known.unknown_optimizers.is_empty());
        // --optimizer then names it, where it said to build an optimizer in the cell.
        let refused = crate::rewrite::rewrite(
            &cell,
            &crate::rewrite::Options {
                optimizer: Some(crate::rewrite::OptimizerChoice::Adafactor),
                ..Default::default()
            },
            &assembled.known,
        )
        .unwrap_err()
        .to_string();
        assert!(
            refused.contains("`opt` (a `SparseAdam`, built in cell [3]), one the notebook wrote"),
            "{refused}"
        );
    }

    #[test]
    fn a_type_built_on_the_store_is_an_optimizer_only_when_it_steps() {
        // A model whose constructor takes the store itself, with no `step`, stays a model.
        let earlier = cells(&[
            "struct Net { fc: nn::Linear }\nimpl Net {\n    fn new(vs: &nn::VarStore) -> Net \
             { todo!() }\n}",
            "let vs = nn::VarStore::new(Device::Cpu);\nlet net = Net::new(&vs);",
        ]);
        let assembled = assemble(WRITTEN_LOOP, &earlier, Wanted::TRIAL);
        assert!(assembled.rebuilt.is_empty(), "{:?}", assembled.rebuilt);
        // An EMA of the weights (a `step` but no `zero_grad`) beside tch's Adam is neither
        // rebuilt by a trial nor counted as the optimizer.
        let earlier = cells(&[
            "struct Ema { decay: f64 }\nimpl Ema {\n    fn new(vs: &nn::VarStore, decay: f64) -> \
             Ema { todo!() }\n    fn step(&mut self) {}\n}",
            MODEL,
            "let mut ema = Ema::new(&vs, 0.999);",
        ]);
        let with_ema = format!("{LOOP}\nema.step();");
        let brought: Vec<String> = assemble(&with_ema, &earlier, Wanted::TRIAL)
            .rebuilt
            .into_iter()
            .map(|r| r.name)
            .collect();
        assert_eq!(brought, ["opt"]);
        let model = live_model(&earlier).unwrap();
        assert_eq!(model.optimizers.len(), 1);
        assert_eq!(model.optimizers[0].name, "opt");
        // One of a crate's types (no impl in the notebook) is taken when the loop steps it.
        let earlier = cells(&[
            "let vs = nn::VarStore::new(Device::Cpu);\nlet net = net(&vs.root());\n\
             let mut opt = lamb::Lamb::new(&vs, 1e-3).unwrap();",
        ]);
        let assembled = assemble(WRITTEN_LOOP, &earlier, Wanted::TRIAL);
        assert_eq!(assembled.rebuilt[0].name, "opt");
        let lamb = &assembled.known.unknown_optimizers[0];
        assert_eq!(
            (lamb.kind.name.as_str(), lamb.kind.in_notebook),
            ("Lamb", false)
        );
        assert_eq!(lamb.origin(), "one of a type tchmem does not know");
        assert!(assemble("let y = opt.lr();", &earlier, Wanted::TRIAL)
            .rebuilt
            .is_empty());
    }

    #[test]
    fn an_optimizer_a_function_of_the_notebook_builds_is_brought_with_its_rule() {
        let earlier = cells(&[
            "fn make_opt(vs: &nn::VarStore) -> nn::Optimizer {\n    \
             nn::AdamW::default().build(vs, 1e-3).unwrap()\n}",
            "let vs = nn::VarStore::new(Device::Cpu);\nlet net = net(&vs.root());\n\
             let mut opt = make_opt(&vs);",
        ]);
        // Trials build a fresh one from the statement, and count AdamW's state.
        let assembled = assemble(LOOP, &earlier, Wanted::TRIAL);
        assert_eq!(brought(&assembled), [("opt", Brought::Optimizer)]);
        assert_eq!(
            assembled.known.rules_built_by_functions,
            [("AdamW".to_string(), OptimizerRule::AdamW)]
        );
        // Before any loop, %memestimate reads the same rule.
        let model = live_model(&earlier).unwrap();
        assert_eq!(
            model.optimizers[0].rule,
            Some(("AdamW".to_string(), OptimizerRule::AdamW))
        );
        // Called in the training cell itself, the rule is read the same way.
        let own = format!("let mut opt = make_opt(&vs);\n{LOOP}");
        let assembled = assemble(&own, &earlier, Wanted::TRIAL);
        assert!(assembled.rebuilt.is_empty(), "{:?}", assembled.rebuilt);
        assert_eq!(
            assembled.known.rules_built_by_functions,
            [("AdamW".to_string(), OptimizerRule::AdamW)]
        );
        // A function that builds none or two, trains with one inside (an LR sweep), returns a
        // model beside it, or is given two stores, is no optimizer's.
        for (function, call) in [
            (
                "fn make_opt(vs: &nn::VarStore) -> nn::Optimizer { nn::seq() }",
                "make_opt(&vs)",
            ),
            (
                "fn make_opt(vs: &nn::VarStore) -> nn::Optimizer { if fast { \
                 nn::Sgd::default().build(vs, 0.1).unwrap() } else { \
                 nn::Adam::default().build(vs, 1e-3).unwrap() } }",
                "make_opt(&vs)",
            ),
            (
                "fn lr_find(vs: &nn::VarStore) -> Vec<f64> { let mut opt = \
                 nn::Sgd::default().build(vs, 1e-7).unwrap(); vec![] }",
                "lr_find(&vs)",
            ),
            (
                "fn make(vs: &nn::VarStore) -> (Net, nn::Optimizer) { (Net::new(&vs.root()), \
                 nn::Adam::default().build(vs, 1e-3).unwrap()) }",
                "make(&vs)",
            ),
            (
                "fn make_opt(a: &nn::VarStore, b: &nn::VarStore) -> nn::Optimizer { \
                 nn::Adam::default().build(b, 1e-3).unwrap() }",
                "make_opt(&vs, &head_vs)",
            ),
        ] {
            let earlier = cells(&[
                function,
                &format!(
                    "let vs = nn::VarStore::new(Device::Cpu);\n\
                     let head_vs = nn::VarStore::new(Device::Cpu);\nlet mut opt = {call};"
                ),
            ]);
            let assembled = assemble(LOOP, &earlier, Wanted::TRIAL);
            assert!(
                assembled.rebuilt.is_empty(),
                "{function}: {:?}",
                assembled.rebuilt
            );
        }
    }

    #[test]
    fn the_newest_definition_wins_and_the_cells_own_bindings_are_its_own() {
        // `opt` redefined by a call the kernel cannot rebuild: the older build is not the live one.
        let earlier = cells(&[MODEL, "let mut opt = make_optimizer(&vs);"]);
        let assembled = assemble(LOOP, &earlier, Wanted::TRIAL);
        assert!(assembled.rebuilt.is_empty(), "{:?}", assembled.rebuilt);
        // A newer SGD replaces the Adam.
        let earlier = cells(&[
            MODEL,
            "let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();",
        ]);
        let assembled = assemble(LOOP, &earlier, Wanted::TRIAL);
        assert_eq!(assembled.rebuilt[0].run, 2);
        // A cell that builds its own optimizer and batch takes neither.
        let own = format!(
            "let batch_size = 8;\nlet mut opt = nn::Sgd::default().build(&vs, 0.1)?;\n{LOOP}"
        );
        let assembled = assemble(
            &own,
            &cells(&["const BATCH_SIZE: i64 = 1;", MODEL]),
            Wanted::TRIAL,
        );
        assert_eq!(assembled.rebuilt.len(), 1, "{:?}", assembled.rebuilt);
        assert_eq!(assembled.rebuilt[0].name, "BATCH_SIZE");
        // Names an earlier cell bound in a block or function are not live.
        let earlier = cells(&["fn f() { let batch_size = 3; }\n{ let mut opt = nn::Adam::default().build(&vs, 1.0)?; }"]);
        assert!(assemble(LOOP, &earlier, Wanted::TRIAL).rebuilt.is_empty());
        // An earlier cell that does not parse is skipped.
        assert!(assemble(LOOP, &cells(&["let = ;"]), Wanted::TRIAL)
            .rebuilt
            .is_empty());
    }
}
