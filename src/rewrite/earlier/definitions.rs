//! The top-level definitions of earlier cells: what each binds (a VarStore, an optimizer, a
//! batch size, a function, another value), the live one of each name, and the names a cell
//! uses and binds itself.

use std::collections::{HashMap, HashSet};

use proc_macro2::{TokenStream, TokenTree};
use quote::ToTokens;
use syn::{Item, Stmt};

use super::{Brought, EarlierCell, UnknownOptimizer};
use crate::cell_syntax;
use crate::rewrite::syntax::{
    as_mut_ref_ident, as_ref_ident, call_under, is_nn_path, single_name, walk_tokens,
};
use crate::rewrite::tree::Tree;
use crate::rewrite::{batch, cell, checkpoint, optimizer, rule_of};
use tchmem_wire::estimate::OptimizerRule;

/// The live definitions of the earlier cells, read in one pass: the newest cell's of each
/// name, and in a cell its last; each with its cell and the statement's index there. Variables
/// and functions are apart (`let net = net(&vs.root());` after `fn net(..)`).
pub(super) struct Live {
    pub(super) values: HashMap<String, (usize, usize, Definition)>,
    pub(super) functions: HashMap<String, (usize, usize, Definition)>,
    /// The types that implement `Module` or `ModuleT` or have a forward method of their own,
    /// with the cell of the newest such impl.
    pub(super) module_types: HashMap<String, usize>,
    /// What each name the cells' `use` lines import stands for (the newest cell's).
    pub(super) imports: HashMap<String, Vec<String>>,
    /// The types with an optimizer's methods of their own (an optimizer the notebook wrote).
    pub(super) stepping_types: HashSet<String>,
}

impl Live {
    /// The live definitions of `earlier` (oldest first).
    pub(super) fn of(earlier: &[EarlierCell]) -> Live {
        let mut live = Live {
            values: HashMap::new(),
            functions: HashMap::new(),
            module_types: HashMap::new(),
            imports: HashMap::new(),
            stepping_types: HashSet::new(),
        };
        for earlier in earlier.iter().rev() {
            // Parsed once for the three readings below.
            let Ok(parsed) = cell::parse(&earlier.code) else {
                continue;
            };
            for (name, path) in super::library::imports(&parsed.block) {
                live.imports.entry(name).or_insert(path);
            }
            for module_type in module_impls(&parsed.block) {
                live.module_types.entry(module_type).or_insert(earlier.run);
            }
            live.stepping_types.extend(stepping_impls(&parsed.block));
            let definitions = definitions(&earlier.code, &parsed);
            for (index, definition) in definitions.into_iter().enumerate().rev() {
                let names = if definition.function {
                    &mut live.functions
                } else {
                    &mut live.values
                };
                names
                    .entry(definition.name.clone())
                    .or_insert((earlier.run, index, definition));
            }
        }
        live.mark_optimizers_built_by_functions();
        live
    }

    /// Marks the values a function of the notebook's builds on a VarStore when the function
    /// builds one of tch's or tchmem's optimizers (`let mut opt = make_optimizer(&vs);` with
    /// `fn make_optimizer(vs: &nn::VarStore) -> nn::Optimizer { nn::Adam::default().build(vs,
    /// 1e-3).unwrap() }`): trials build one afresh from the statement, and its state is
    /// counted by the build's rule.
    fn mark_optimizers_built_by_functions(&mut self) {
        let is_store = |name: &String| {
            self.values
                .get(name)
                .is_some_and(|(_, _, d)| matches!(d.what, Some(Defined::VarStore)))
        };
        let built: Vec<(String, Built)> = self
            .values
            .iter()
            .filter(|(_, (_, _, d))| d.what.is_none())
            .filter_map(|(name, (_, _, d))| {
                let call = d.function_call.as_ref()?;
                // Given two stores, which one it builds on is the function's to say: none.
                let [store] = call
                    .arguments
                    .iter()
                    .filter(|a| is_store(a))
                    .collect::<Vec<_>>()[..]
                else {
                    return None;
                };
                let store = store.clone();
                let (_, _, function) = self.functions.get(&call.function)?;
                let rule = built_rule(&function.code)?;
                let built = Built {
                    store: Some(store),
                    rule: Some(rule),
                    unknown: None,
                };
                Some((name.clone(), built))
            })
            .collect();
        for (name, built) in built {
            if let Some((_, _, definition)) = self.values.get_mut(&name) {
                definition.what = Some(Defined::Brought(Brought::Optimizer));
                definition.optimizer = Some(built);
            }
        }
    }

    /// The values that a type of the notebook's makes on a whole VarStore
    /// (`SparseAdam::new(&vs, 5e-3, …)`) when the type has an optimizer's methods of its own
    /// (`fn step(&mut self)` and `zero_grad`; not a model's forward): what `%memestimate` counts
    /// as optimizers before any loop.
    pub(super) fn optimizers_of_the_notebook(&self) -> Vec<String> {
        self.values
            .iter()
            .filter(|(_, (_, _, d))| {
                d.type_call.as_ref().is_some_and(|call| {
                    self.stepping_types.contains(&call.type_name)
                        && !self.module_types.contains_key(&call.type_name)
                })
            })
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Marks the values of `names` that a type's function builds on a whole VarStore as
    /// optimizers of a type tchmem does not know (the notebook's own, or a crate's): tch's models
    /// take a path of the store (`vs.root()`), its optimizers the store itself. A trial then
    /// builds one afresh from the statement.
    pub(super) fn mark_unknown_optimizers(&mut self, names: &[String]) {
        for name in names {
            let store = self.values.get(name).and_then(|(_, _, d)| {
                let call = d.type_call.as_ref().filter(|_| d.what.is_none())?;
                let store = call.arguments.iter().find(|argument| {
                    self.values
                        .get(*argument)
                        .is_some_and(|(_, _, s)| matches!(s.what, Some(Defined::VarStore)))
                })?;
                Some((store.clone(), call.type_name.clone()))
            });
            let (Some((store, type_name)), Some((_, _, definition))) =
                (store, self.values.get_mut(name))
            else {
                continue;
            };
            let in_notebook = self.stepping_types.contains(&type_name);
            definition.what = Some(Defined::Brought(Brought::Optimizer));
            definition.optimizer = Some(Built {
                store: Some(store),
                rule: None,
                unknown: Some(UnknownType {
                    name: type_name,
                    in_notebook,
                }),
            });
        }
    }
}

/// The type of an optimizer that is neither tch's nor tchmem's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownType {
    /// Its name (`SparseAdam`).
    pub name: String,
    /// Whether an earlier cell implements it (the notebook wrote it), rather than a crate.
    pub in_notebook: bool,
}

/// What a top-level definition of an earlier cell is, when it matters to a trial.
pub(super) enum Defined {
    Brought(Brought),
    VarStore,
}

/// A name a cell's top level binds.
pub(super) struct Definition {
    pub(super) name: String,
    pub(super) what: Option<Defined>,
    /// For an optimizer: the store it is built on and its rule.
    pub(super) optimizer: Option<Built>,
    pub(super) code: String,
    /// The identifiers in its statement.
    pub(super) uses: HashSet<String>,
    /// For a `let`: the text of its pattern (`mut net`, `net: nn::Sequential`) and of its
    /// initializer (`net(&vs.root())`).
    pub(super) local: Option<(String, Option<String>)>,
    /// A function (its name is in the functions' namespace).
    pub(super) function: bool,
    /// Whether it calls `nn::seq()` or `nn::seq_t()` itself.
    pub(super) has_seq: bool,
    /// For a `let` of a type's function (`SparseAdam::new(&vs, 5e-3)?`): the type and the
    /// variables passed whole.
    pub(super) type_call: Option<TypeCall>,
    /// For a `let` of a function of the notebook's (`make_optimizer(&vs)?`): the function and
    /// the variables passed whole.
    pub(super) function_call: Option<FunctionCall>,
}

/// A value built by a type's function (`SparseAdam::new(&vs, 5e-3, 0.9)`, perhaps with `?` or
/// `.unwrap()`), and the variables it is given whole (`vs` of `&vs`, `&mut vs` or `vs`).
pub(super) struct TypeCall {
    pub(super) type_name: String,
    pub(super) arguments: Vec<String>,
}

impl TypeCall {
    /// The call `init` makes, when it is a function of a type (the path's segment before the
    /// function starts with a capital: `SparseAdam::new`, not `nn::linear`).
    fn of(init: &syn::Expr) -> Option<TypeCall> {
        let (func, call) = path_call(init)?;
        let segments = &func.path.segments;
        let type_name = segments.iter().rev().nth(1)?.ident.to_string();
        if !type_name.starts_with(char::is_uppercase) || func.qself.is_some() {
            return None;
        }
        Some(TypeCall {
            type_name,
            arguments: whole_arguments(call),
        })
    }
}

/// A value built by a function of the notebook's (`make_optimizer(&vs)`, perhaps with `?` or
/// `.unwrap()`), and the variables it is given whole.
pub(super) struct FunctionCall {
    pub(super) function: String,
    pub(super) arguments: Vec<String>,
}

impl FunctionCall {
    /// The call `init` makes, when it is a function named by one plain name.
    fn of(init: &syn::Expr) -> Option<FunctionCall> {
        let (func, call) = path_call(init)?;
        let function = func.path.get_ident()?.to_string();
        Some(FunctionCall {
            function,
            arguments: whole_arguments(call),
        })
    }
}

/// The call `init` makes of a function named by a path (perhaps under `?` or `.unwrap()`), and
/// that path: what [`TypeCall`] and [`FunctionCall`] read.
fn path_call(init: &syn::Expr) -> Option<(&syn::ExprPath, &syn::ExprCall)> {
    let call = call_under(init, &["unwrap", "expect"])?;
    match &*call.func {
        syn::Expr::Path(func) => Some((func, call)),
        _ => None,
    }
}

/// The variables a call is given whole (`vs` of `&vs`, `&mut vs`).
fn whole_arguments(call: &syn::ExprCall) -> Vec<String> {
    call.args
        .iter()
        .filter_map(|argument| as_ref_ident(argument).or_else(|| as_mut_ref_ident(argument)))
        .map(|ident| ident.to_string())
        .collect()
}

/// The rule of the one optimizer of tch's or tchmem's a function's code builds
/// (`nn::Adam::default().build(vs, 1e-3)`), if it builds exactly one and returns an optimizer
/// (`-> nn::Optimizer`, `-> Result<nn::Optimizer>`, tchmem's): a function that trains with
/// one inside (an LR sweep) or returns a model beside it is no optimizer's.
fn built_rule(function_code: &str) -> Option<(String, OptimizerRule)> {
    let parsed = cell::parse(function_code).ok()?;
    let returns_an_optimizer = parsed.block.stmts.iter().any(|stmt| {
        let Stmt::Item(Item::Fn(function)) = stmt else {
            return false;
        };
        let syn::ReturnType::Type(_, output) = &function.sig.output else {
            return false;
        };
        let text = output.to_token_stream().to_string();
        text.contains("Optimizer") && !text.contains('(')
    });
    if !returns_an_optimizer {
        return None;
    }
    let builds = optimizer::builds(&Tree::of(&parsed.block));
    match builds.as_slice() {
        [build] => rule_of(&build.config),
        _ => None,
    }
}

impl Definition {
    /// Whether it is a `let` of an `nn::linear(…)` (perhaps with `?` or `.unwrap()`).
    pub(super) fn makes_linear(&self) -> bool {
        let Some((_, Some(init))) = &self.local else {
            return false;
        };
        let Ok(expr) = syn::parse_str::<syn::Expr>(init) else {
            return false;
        };
        call_under(&expr, &["unwrap"]).is_some_and(
            |call| matches!(&*call.func, syn::Expr::Path(p) if is_nn_path(&p.path, &["linear"])),
        )
    }
}

/// An optimizer's build in an earlier cell.
pub(super) struct Built {
    /// `vs` of `.build(&vs, ..)`.
    pub(super) store: Option<String>,
    pub(super) rule: Option<(String, OptimizerRule)>,
    /// For an optimizer of a type tchmem does not know: that type.
    pub(super) unknown: Option<UnknownType>,
}

impl Built {
    /// The optimizer `name` (built in cell `run`), when its type is one tchmem does not know.
    pub(super) fn unknown_optimizer(&self, name: &str, run: usize) -> Option<UnknownOptimizer> {
        Some(UnknownOptimizer {
            name: name.to_string(),
            run,
            store: self.store.clone()?,
            kind: self.unknown.clone()?,
        })
    }
}

/// The top-level bindings of `code`, `parsed` (a `let` of one name, a `const`, a `static`).
fn definitions(code: &str, parsed: &cell::Cell) -> Vec<Definition> {
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
                unknown: None,
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
        } else if init.is_some_and(|init| batch::is_batch_binding(&name, init)) {
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
            uses: names_in(stmt.to_token_stream()),
            local: match stmt {
                Stmt::Local(local) => {
                    let text =
                        |node: &dyn syn::spanned::Spanned| parsed.text_at(node.span()).to_string();
                    let init = local.init.as_ref().map(|init| text(&*init.expr));
                    Some((text(&local.pat), init))
                }
                _ => None,
            },
            function: matches!(stmt, Stmt::Item(Item::Fn(_))),
            has_seq: checkpoint::builds_seq(stmt),
            type_call: match stmt {
                Stmt::Local(local) => local
                    .init
                    .as_ref()
                    .and_then(|init| TypeCall::of(&init.expr)),
                _ => None,
            },
            function_call: match stmt {
                Stmt::Local(local) => local
                    .init
                    .as_ref()
                    .and_then(|init| FunctionCall::of(&init.expr)),
                _ => None,
            },
        });
    }
    out
}

/// The types the cell implements `Module` or `ModuleT` for (`impl nn::ModuleT for Net`), or
/// gives a `forward`/`forward_t` method of their own (`impl Vae { fn forward(..) }`).
fn module_impls(block: &syn::Block) -> Vec<String> {
    impl_types(block, |item| match &item.trait_ {
        Some((_, path, _)) => path
            .segments
            .last()
            .is_some_and(|s| s.ident == "Module" || s.ident == "ModuleT"),
        None => has_method(item, &["forward", "forward_t"]),
    })
}

/// The types the cell gives an optimizer's methods: `fn step(&mut self)` with no other input,
/// and `zero_grad` (an EMA's `step` or a recurrent cell's `step(&self, x, state)` are not).
fn stepping_impls(block: &syn::Block) -> Vec<String> {
    impl_types(block, |item| {
        let steps = item.items.iter().any(|member| {
            matches!(member, syn::ImplItem::Fn(f)
                if f.sig.ident == "step"
                    && f.sig.inputs.len() == 1
                    && matches!(f.sig.inputs.first(),
                        Some(syn::FnArg::Receiver(r)) if r.mutability.is_some()))
        });
        steps && has_method(item, &["zero_grad"])
    })
}

/// The types of the cell's top-level impls that `pick` takes.
fn impl_types(block: &syn::Block, pick: impl Fn(&syn::ItemImpl) -> bool) -> Vec<String> {
    block
        .stmts
        .iter()
        .filter_map(|stmt| {
            let Stmt::Item(Item::Impl(item)) = stmt else {
                return None;
            };
            let syn::Type::Path(ty) = &*item.self_ty else {
                return None;
            };
            pick(item)
                .then(|| ty.path.segments.last().map(|s| s.ident.to_string()))
                .flatten()
        })
        .collect()
}

/// Whether the impl has a method of one of `names`.
fn has_method(item: &syn::ItemImpl, names: &[&str]) -> bool {
    item.items.iter().any(|member| {
        matches!(member, syn::ImplItem::Fn(f) if names.iter().any(|name| f.sig.ident == name))
    })
}

/// Every identifier in `tokens` (a superset of the names they use).
pub(in crate::rewrite) fn names_in(tokens: TokenStream) -> HashSet<String> {
    let mut names = HashSet::new();
    walk_tokens(tokens, &mut |tree| {
        if let TokenTree::Ident(ident) = tree {
            names.insert(ident.to_string());
        }
    });
    names
}

/// Every identifier of the cell (empty when it does not parse): the functions it may call, whose
/// namespace its `let`s do not shadow (`let loss = loss(&x, &y);`).
pub(super) fn all_names(cell: &str) -> Vec<String> {
    cell::parse(cell)
        .map(|parsed| {
            names_in(parsed.block.to_token_stream())
                .into_iter()
                .collect()
        })
        .unwrap_or_default()
}

/// The names the cell uses but does not bind itself (by a `let`, `const` or `static` in it):
/// those it may take from earlier cells. None when it does not parse.
pub(super) fn free_names(cell: &str) -> Vec<String> {
    let Ok(parsed) = cell::parse(cell) else {
        return Vec::new();
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
    let mut bound = Binder(HashSet::new());
    syn::visit::Visit::visit_block(&mut bound, &parsed.block);
    names_in(parsed.block.to_token_stream())
        .into_iter()
        .filter(|name| !bound.0.contains(name))
        .collect()
}
