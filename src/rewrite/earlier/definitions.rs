//! The top-level definitions of earlier cells: what each binds (a VarStore, an optimizer, a
//! batch size, a function, another value), the live one of each name, and the names a cell
//! uses and binds itself.

use std::collections::{HashMap, HashSet};

use proc_macro2::{TokenStream, TokenTree};
use quote::ToTokens;
use syn::{Expr, Item, Stmt};

use super::{Brought, EarlierCell};
use crate::cell_syntax;
use crate::rewrite::syntax::{as_ref_ident, walk_tokens};
use crate::rewrite::tree::Tree;
use crate::rewrite::{cell, checkpoint, optimizer, rule_of};
use tchmem_wire::estimate::OptimizerRule;

/// The live definition of each name the cells bound at their top level: the newest cell's, and
/// in a cell its last; with the cell and the statement's index in it.
pub(super) fn live_definitions(
    earlier: &[EarlierCell],
) -> HashMap<String, (usize, usize, Definition)> {
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
pub(super) fn live_functions(earlier: &[EarlierCell]) -> HashMap<String, (usize, Definition)> {
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
    /// A `let` (not a const or static).
    pub(super) local: bool,
    /// The text of its initializer (`net(&vs.root())`), for a `let`.
    pub(super) init: Option<String>,
    /// For a function: `Some(())` (its name is in the functions' namespace).
    pub(super) function: Option<()>,
    /// Whether it calls `nn::seq()` or `nn::seq_t()` itself.
    pub(super) has_seq: bool,
}

/// An optimizer's build in an earlier cell.
pub(super) struct Built {
    /// `vs` of `.build(&vs, ..)`.
    pub(super) store: Option<String>,
    pub(super) rule: Option<(String, OptimizerRule)>,
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
pub(super) fn names_in(tokens: &Option<TokenStream>) -> HashSet<String> {
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
pub(super) fn bound_names(cell: &str) -> HashSet<String> {
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
pub(super) fn rust_tokens(cell: &str) -> Option<TokenStream> {
    cell::parse(cell)
        .ok()
        .map(|parsed| parsed.block.to_token_stream())
}
