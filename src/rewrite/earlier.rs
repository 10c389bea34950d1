//! What a training cell takes from the cells before it.
//!
//! The kernel keeps the code of every cell that ran ([`EarlierCell`]). A magic that runs a cell
//! in trials (`--compare`, `%memestimate`, `%memfit`, `--fit`, the OOM diagnosis) follows the
//! names the cell uses but does not bind back to the newest cell that defined them, and brings
//! in front of the cell what a trial must have in its own code ([`assemble`]):
//! - the batch size (`const BATCH_SIZE: i64 = 64;`, `let batch_size = 64;`), so that the trials
//!   can vary it;
//! - the optimizer (`let mut opt = nn::Adam::default().build(&vs, 1e-3)?;`), so that a trial
//!   steps a fresh one (the user's keeps its state) and `--optimizer` can swap it.
//!
//! It also names the VarStores the cell uses that were made earlier: a trial keeps their
//! tensors and puts them back after it (the runtime's `tchmem::keep`), so that the user's model
//! is the same after the magic as before it, and both sides of `--compare` start from it.

use std::collections::{HashMap, HashSet};

use proc_macro2::{TokenStream, TokenTree};
use quote::ToTokens;
use syn::{Expr, Item, Stmt};

use super::cell;
use super::checkpoint;
use super::optimizer;
use super::syntax::{as_ref_ident, walk_tokens};
use super::tree::Tree;
use super::{rule_of, Change, Refusal};
use crate::cell_syntax;
use tchmem_wire::estimate::OptimizerRule;

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
}

impl Wanted {
    /// What a trial needs: the batch and a fresh optimizer.
    pub const TRIAL: Wanted = Wanted {
        batch: true,
        optimizer: true,
        model: false,
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
}

impl Assembled {
    /// `refusal` (about `code`) in the cell's own terms: a line of the cell is moved up by the
    /// prelude; a line of the prelude is named by the cell it came from.
    pub fn in_cell_terms(&self, refusal: Refusal) -> Refusal {
        match refusal.line {
            Some(line) if line > self.prelude_lines => Refusal {
                line: Some(line - self.prelude_lines),
                ..refusal
            },
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
                    "the model `{}` is built in cell [{}] by functions of earlier cells: \
                     rebuilt here with them, on a VarStore of its own into which the \
                     notebook's weights are copied (the rebuilt model, its store and the \
                     optimizer replace the notebook's where the cell's variables are kept)",
                    rebuilt.name, rebuilt.run
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
            out.push(moved);
        }
        out
    }
}

/// `cell` with the definitions `wanted` from `earlier` cells (oldest first) in front of it.
pub fn assemble(cell: &str, earlier: &[EarlierCell], wanted: Wanted) -> Assembled {
    let live = live_definitions(earlier);
    let bound = bound_names(cell);
    let direct: Vec<String> = names_in(&rust_tokens(cell))
        .into_iter()
        .filter(|name| !bound.contains(name))
        .collect();
    let model = if wanted.model {
        let functions = live_functions(earlier);
        direct
            .iter()
            .find_map(|name| rebuilt_model(name, &live, &functions))
    } else {
        None
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
    }
}

/// The live definition of each name the cells bound at their top level: the newest cell's, and
/// in a cell its last; with the cell and the statement's index in it.
fn live_definitions(earlier: &[EarlierCell]) -> HashMap<String, (usize, usize, Definition)> {
    let mut live: HashMap<String, (usize, usize, Definition)> = HashMap::new();
    for earlier in earlier.iter().rev() {
        for (index, definition) in definitions(&earlier.code).into_iter().enumerate().rev() {
            if definition.function.is_none() {
                live.entry(definition.name.clone())
                    .or_insert((earlier.run, index, definition));
            }
        }
    }
    live
}

/// The live definition of each function the cells defined at their top level (functions and
/// variables are apart: `let net = net(&vs.root());` after `fn net(..)`).
fn live_functions(earlier: &[EarlierCell]) -> HashMap<String, (usize, Definition)> {
    let mut live: HashMap<String, (usize, Definition)> = HashMap::new();
    for earlier in earlier.iter().rev() {
        for definition in definitions(&earlier.code).into_iter().rev() {
            if definition.function.is_some() {
                live.entry(definition.name.clone())
                    .or_insert((earlier.run, definition));
            }
        }
    }
    live
}

/// The model `name` rebuilt, when its live definition is a `let` that builds an `nn::seq()` or
/// `nn::seq_t()` (itself or through functions of earlier cells) from one VarStore of an earlier
/// cell: a block that builds it again, with those functions, on a new store, and copies the
/// notebook's weights into it.
fn rebuilt_model(
    name: &str,
    live: &HashMap<String, (usize, usize, Definition)>,
    functions: &HashMap<String, (usize, Definition)>,
) -> Option<Rebuilt> {
    let (run, _, definition) = live.get(name)?;
    if definition.what.is_some() || !definition.local {
        return None;
    }
    // The functions it calls, and those they call.
    let mut reached: Vec<&str> = Vec::new();
    let mut todo: Vec<&str> = definition.uses.iter().map(String::as_str).collect();
    while let Some(next) = todo.pop() {
        if let Some((_, function)) = functions.get(next) {
            if !reached.contains(&next) {
                reached.push(next);
                todo.extend(function.uses.iter().map(String::as_str));
            }
        }
    }
    let builds_seq = definition.has_seq || reached.iter().any(|f| functions[*f].1.has_seq);
    let stores: Vec<&String> = definition
        .uses
        .iter()
        .filter(|used| {
            live.get(*used)
                .is_some_and(|(_, _, d)| matches!(d.what, Some(Defined::VarStore)))
        })
        .collect();
    let [store] = stores.as_slice() else {
        return None;
    };
    if !builds_seq {
        return None;
    }
    // In the order they were defined.
    reached.sort_by_key(|f| (functions[*f].0, functions[*f].1.code.clone()));
    let items: String = reached
        .iter()
        .map(|f| format!("{}\n", functions[*f].1.code))
        .collect();
    let init = definition.init.as_deref()?;
    let binding = definition
        .code
        .split('=')
        .next()
        .unwrap_or("let ")
        .trim_end();
    // The new store is the only one the model's code sees (`vs` inside the block); the
    // notebook's weights are copied into it, then it takes the store's name.
    let code = format!(
        "let mut __tchmem_store = tch::nn::VarStore::new({store}.device());\n\
         {binding} = {{\n\
         let {store} = &__tchmem_store;\n\
         {items}{init}\n\
         }};\n\
         __tchmem_store.copy(&{store}).expect(\"tchmem: copying the notebook's weights into \
         the rebuilt model\");\n\
         let mut {store} = __tchmem_store;"
    );
    Some(Rebuilt {
        name: name.to_string(),
        run: *run,
        what: Brought::Model,
        code,
    })
}

/// The model the notebook holds now, as earlier cells made it (what `%memestimate` counts
/// before any training loop ran).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveModel {
    /// Its VarStores and the cells that made them: the one the optimizer is built on, else
    /// every live one.
    pub stores: Vec<(String, usize)>,
    /// The optimizer built on it, if one is.
    pub optimizer: Option<LiveOptimizer>,
}

/// An optimizer an earlier cell built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveOptimizer {
    /// Its variable.
    pub name: String,
    /// The cell that built it.
    pub run: usize,
    /// Its type's name and state rule, when the kernel knows them.
    pub rule: Option<(String, OptimizerRule)>,
}

/// The model the earlier cells left, `None` when no VarStore of theirs is live.
pub fn live_model(earlier: &[EarlierCell]) -> Option<LiveModel> {
    let live = live_definitions(earlier);
    let mut stores: Vec<(String, usize)> = live
        .iter()
        .filter(|(_, (_, _, d))| matches!(d.what, Some(Defined::VarStore)))
        .map(|(name, (run, _, _))| (name.clone(), *run))
        .collect();
    stores.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
    if stores.is_empty() {
        return None;
    }
    // The newest optimizer built on a live store.
    let optimizer = live
        .iter()
        .filter_map(|(name, (run, index, d))| {
            let built = d.optimizer.as_ref()?;
            let store = built.store.as_ref()?;
            stores.iter().any(|(s, _)| s == store).then(|| {
                (
                    (*run, *index),
                    store.clone(),
                    LiveOptimizer {
                        name: name.clone(),
                        run: *run,
                        rule: built.rule.clone(),
                    },
                )
            })
        })
        .max_by_key(|(at, _, _)| *at);
    if let Some((_, store, _)) = &optimizer {
        stores.retain(|(s, _)| s == store);
    }
    Some(LiveModel {
        stores,
        optimizer: optimizer.map(|(_, _, o)| o),
    })
}

/// What a top-level definition of an earlier cell is, when it matters to a trial.
enum Defined {
    Brought(Brought),
    VarStore,
}

/// A name a cell's top level binds.
struct Definition {
    name: String,
    what: Option<Defined>,
    /// For an optimizer: the store it is built on and its rule.
    optimizer: Option<Built>,
    code: String,
    /// The identifiers in its statement.
    uses: HashSet<String>,
    /// A `let` (not a const or static).
    local: bool,
    /// The text of its initializer (`net(&vs.root())`), for a `let`.
    init: Option<String>,
    /// For a function: `Some(())` (its name is in the functions' namespace).
    function: Option<()>,
    /// Whether it calls `nn::seq()` or `nn::seq_t()` itself.
    has_seq: bool,
}

/// An optimizer's build in an earlier cell.
struct Built {
    /// `vs` of `.build(&vs, ..)`.
    store: Option<String>,
    rule: Option<(String, OptimizerRule)>,
}

/// The top-level bindings of `code` (a `let` of one name, a `const`, a `static`).
fn definitions(code: &str) -> Vec<Definition> {
    let Ok(parsed) = cell::parse(code) else {
        return Vec::new();
    };
    let stores: HashSet<String> = cell_syntax::var_store_bindings(code)
        .into_iter()
        .filter(|binding| binding.top_level)
        .map(|binding| binding.name)
        .collect();
    let tree = Tree::of(&parsed.block);
    let mut optimizers: HashMap<usize, Built> = optimizer::builds(&tree)
        .into_iter()
        .filter(|build| build.block == 0 && build.binding.is_some())
        .map(|build| {
            let built = Built {
                store: as_ref_ident(&build.vs).map(|ident| ident.to_string()),
                rule: rule_of(&build.config),
            };
            (build.index, built)
        })
        .collect();
    let mut out = Vec::new();
    for (index, stmt) in parsed.block.stmts.iter().enumerate() {
        let (name, init) = match stmt {
            Stmt::Local(local) => {
                let Some(name) = single_name(&local.pat) else {
                    continue;
                };
                (name, local.init.as_ref().map(|init| &*init.expr))
            }
            Stmt::Item(Item::Const(item)) => (item.ident.to_string(), Some(&*item.expr)),
            Stmt::Item(Item::Static(item)) => (item.ident.to_string(), Some(&*item.expr)),
            Stmt::Item(Item::Fn(item)) => (item.sig.ident.to_string(), None),
            _ => continue,
        };
        let what = if stores.contains(&name) {
            Some(Defined::VarStore)
        } else if optimizers.contains_key(&index) {
            Some(Defined::Brought(Brought::Optimizer))
        } else if name.to_lowercase().contains("batch") && init.is_some_and(is_int_literal) {
            Some(Defined::Brought(Brought::BatchSize))
        } else {
            None
        };
        out.push(Definition {
            name,
            what,
            optimizer: optimizers.remove(&index),
            code: parsed
                .text_at(syn::spanned::Spanned::span(stmt))
                .to_string(),
            uses: names_in(&Some(stmt.to_token_stream())),
            local: matches!(stmt, Stmt::Local(_)),
            init: match stmt {
                Stmt::Local(local) => local.init.as_ref().map(|init| {
                    parsed
                        .text_at(syn::spanned::Spanned::span(&*init.expr))
                        .to_string()
                }),
                _ => None,
            },
            function: matches!(stmt, Stmt::Item(Item::Fn(_))).then_some(()),
            has_seq: checkpoint::builds_seq(stmt),
        });
    }
    out
}

/// The name a simple pattern binds (`opt`, `mut opt`, `opt: nn::Optimizer`).
fn single_name(pat: &syn::Pat) -> Option<String> {
    match pat {
        syn::Pat::Ident(ident) if ident.subpat.is_none() => Some(ident.ident.to_string()),
        syn::Pat::Type(typed) => single_name(&typed.pat),
        _ => None,
    }
}

fn is_int_literal(expr: &Expr) -> bool {
    matches!(expr, Expr::Lit(lit) if matches!(lit.lit, syn::Lit::Int(_)))
}

/// Every identifier in `tokens` (a superset of the names they use).
fn names_in(tokens: &Option<TokenStream>) -> HashSet<String> {
    let mut names = HashSet::new();
    if let Some(tokens) = tokens {
        walk_tokens(tokens.clone(), &mut |tree| {
            if let TokenTree::Ident(ident) = tree {
                names.insert(ident.to_string());
            }
        });
    }
    names
}

/// Names the cell binds itself (any `let`, `const`, `static` or `fn` in it): those it does not
/// take from earlier cells.
fn bound_names(cell: &str) -> HashSet<String> {
    let Ok(parsed) = cell::parse(cell) else {
        return HashSet::new();
    };
    struct Binder(HashSet<String>);
    impl<'a> syn::visit::Visit<'a> for Binder {
        fn visit_pat_ident(&mut self, pat: &'a syn::PatIdent) {
            self.0.insert(pat.ident.to_string());
            syn::visit::visit_pat_ident(self, pat);
        }
        fn visit_item_const(&mut self, item: &'a syn::ItemConst) {
            self.0.insert(item.ident.to_string());
            syn::visit::visit_item_const(self, item);
        }
        fn visit_item_static(&mut self, item: &'a syn::ItemStatic) {
            self.0.insert(item.ident.to_string());
            syn::visit::visit_item_static(self, item);
        }
    }
    let mut binder = Binder(HashSet::new());
    syn::visit::Visit::visit_block(&mut binder, &parsed.block);
    binder.0
}

/// The cell's tokens (its Rust part), when it parses.
fn rust_tokens(cell: &str) -> Option<TokenStream> {
    cell::parse(cell)
        .ok()
        .map(|parsed| parsed.block.to_token_stream())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cells(codes: &[&str]) -> Vec<EarlierCell> {
        codes
            .iter()
            .enumerate()
            .map(|(i, code)| EarlierCell {
                run: i + 1,
                code: code.to_string(),
            })
            .collect()
    }

    const MODEL: &str = "let vs = nn::VarStore::new(Device::cuda_if_available());\n\
                         let net = net(&vs.root());\n\
                         let mut opt = nn::Adam::default().build(&vs, 1e-3)?;";
    const LOOP: &str = "for (x, y) in m.train_iter(BATCH_SIZE).shuffle() {\n\
                        \x20   let loss = net.forward(&x).cross_entropy_for_logits(&y);\n\
                        \x20   opt.backward_step(&loss);\n}";

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
            },
        );
        assert_eq!((none.code.as_str(), none.prelude_lines), (LOOP, 0));
    }

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
                "net(&vs.root())\n};\n__tchmem_store.copy(&vs).expect(\"tchmem: copying the \
                 notebook's weights into the rebuilt model\");\nlet mut vs = __tchmem_store;\n"
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
    fn the_live_model_is_the_store_its_optimizer_is_built_on() {
        let model = live_model(&cells(&[
            "let critic = nn::VarStore::new(Device::Cpu);",
            MODEL,
        ]))
        .unwrap();
        assert_eq!(model.stores, vec![("vs".to_string(), 2)]);
        let optimizer = model.optimizer.unwrap();
        assert_eq!((optimizer.name.as_str(), optimizer.run), ("opt", 2));
        assert_eq!(optimizer.rule, Some(("Adam".into(), OptimizerRule::Adam)));
        // No optimizer yet: every live store.
        let model = live_model(&cells(&[
            "let critic = nn::VarStore::new(Device::Cpu);",
            "let vs = nn::VarStore::new(Device::Cpu);",
        ]))
        .unwrap();
        assert_eq!(model.stores.len(), 2);
        assert_eq!(model.optimizer, None);
        assert_eq!(live_model(&cells(&["let x = 1;"])), None);
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
