//! Activation checkpointing: models built with `nn::seq()` / `nn::seq_t()` in the cell are built
//! with `tchmem::checkpoint::seq()` / `seq_t()` instead, which keep only the inputs of each
//! segment and recompute the rest in the backward pass.

use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::visit_mut::{self, VisitMut};
use syn::{Block, Expr};

use super::cell::line_of;
use super::change::Change;
use super::span::FORWARD_METHODS;
use super::syntax::{is_nn_path, strip_parens};
use super::Refusal;

/// `nn::seq()` or `nn::seq_t()` (the function's name), if `expr` is one of those calls.
fn seq_call(expr: &Expr) -> Option<&'static str> {
    let Expr::Call(call) = strip_parens(expr) else {
        return None;
    };
    let Expr::Path(func) = &*call.func else {
        return None;
    };
    if !call.args.is_empty() {
        return None;
    }
    ["seq", "seq_t"]
        .into_iter()
        .find(|name| is_nn_path(&func.path, &[name]))
}

/// Whether `stmt` calls `nn::seq()` or `nn::seq_t()` anywhere in it (a function's body
/// included): what `--checkpoint` rewrites.
pub(crate) fn builds_seq(stmt: &syn::Stmt) -> bool {
    struct Finder(bool);
    impl<'a> Visit<'a> for Finder {
        fn visit_expr(&mut self, expr: &'a Expr) {
            self.0 |= seq_call(expr).is_some();
            syn::visit::visit_expr(self, expr);
        }
    }
    let mut finder = Finder(false);
    finder.visit_stmt(stmt);
    finder.0
}

/// The `nn::seq()` call at the root of a builder chain (`nn::seq().add(…).add_fn(…)`).
fn chain_root(mut expr: &Expr) -> Option<&'static str> {
    loop {
        match strip_parens(expr) {
            Expr::MethodCall(call) => expr = &call.receiver,
            other => return seq_call(other),
        }
    }
}

/// Rewrites every `nn::seq()`/`nn::seq_t()` builder in the cell.
pub(crate) fn apply(
    block: &mut Block,
    segments: Option<u32>,
    changes: &mut Vec<Change>,
) -> Result<(), Refusal> {
    let mut rewriter = Rewriter {
        segments,
        found: Vec::new(),
    };
    rewriter.visit_block_mut(block);
    if rewriter.found.is_empty() {
        let (line, struct_model) = model_hints(block);
        let struct_note = match struct_model {
            Some(name) => format!(
                " (`{name}` implements Module in this cell: build the layers it runs with \
                 tchmem::checkpoint::seq() to checkpoint them)"
            ),
            None => String::new(),
        };
        return Err(Refusal::new(
            format!(
                "--checkpoint looks for a model built with nn::seq() or nn::seq_t() in this \
                 cell, or by a `let` of an earlier cell (and the functions of earlier cells it \
                 calls) that the cell uses; found none{struct_note}. A model of another kind (a \
                 struct implementing Module, an LSTM) is checkpointed where its forward runs: \
                 wrap the layers to recompute in tchmem::checkpoint::checkpoint(|x| …, &x), or \
                 build them with tchmem::checkpoint::seq()."
            ),
            line,
        ));
    }
    let how = match segments {
        Some(n) => format!("{n} segment{}", if n == 1 { "" } else { "s" }),
        None => "√layers segments".to_string(),
    };
    for (line, name) in &rewriter.found {
        changes.push(Change::at(
            *line,
            format!(
                "--checkpoint: nn::{name}() → tchmem::checkpoint::{name}() ({how}): \
             activations inside each segment are recomputed in the backward pass instead of \
             being kept"
            ),
        ));
    }
    Ok(())
}

struct Rewriter {
    segments: Option<u32>,
    /// Line and function of each builder rewritten.
    found: Vec<(usize, &'static str)>,
}

impl Rewriter {
    /// Rewrites the chain's root and visits the arguments along it (they may hold nested
    /// sequential models).
    fn chain(&mut self, expr: &mut Expr) {
        match expr {
            Expr::MethodCall(call) => {
                for arg in call.args.iter_mut() {
                    self.visit_expr_mut(arg);
                }
                self.chain(&mut call.receiver);
            }
            Expr::Paren(paren) => self.chain(&mut paren.expr),
            Expr::Call(call) => {
                if let Some(name) = seq_call(&Expr::Call(call.clone())) {
                    self.found.push((line_of(call.func.span()), name));
                    let ident = proc_macro2::Ident::new(name, proc_macro2::Span::call_site());
                    *call.func = syn::parse_quote!(tchmem::checkpoint::#ident);
                }
            }
            _ => {}
        }
    }
}

impl VisitMut for Rewriter {
    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        if chain_root(expr).is_none() {
            return visit_mut::visit_expr_mut(self, expr);
        }
        self.chain(expr);
        if let Some(n) = self.segments {
            let n = proc_macro2::Literal::u32_unsuffixed(n);
            *expr = syn::parse_quote!(#expr.segments(#n));
        }
    }

    fn visit_type_path_mut(&mut self, ty: &mut syn::TypePath) {
        visit_mut::visit_type_path_mut(self, ty);
        if ty.qself.is_some() {
            return;
        }
        // `nn::SequentialT`, or `SequentialT` imported from tch as tch-rs's examples do: a
        // function that returns the builder's value must name the rewritten builder's type.
        for name in ["Sequential", "SequentialT"] {
            if is_nn_path(&ty.path, &[name]) || ty.path.is_ident(name) {
                let ident = proc_macro2::Ident::new(name, proc_macro2::Span::call_site());
                ty.path = syn::parse_quote!(tchmem::checkpoint::#ident);
            }
        }
    }
}

/// Where the model runs (the first forward call), and the name of a struct implementing
/// `Module`/`ModuleT` in the cell, for the refusal.
fn model_hints(block: &Block) -> (Option<usize>, Option<String>) {
    #[derive(Default)]
    struct Finder {
        forward: Option<usize>,
        struct_model: Option<String>,
    }
    impl<'a> Visit<'a> for Finder {
        fn visit_expr_method_call(&mut self, call: &'a syn::ExprMethodCall) {
            if self.forward.is_none() && FORWARD_METHODS.iter().any(|m| call.method == m) {
                self.forward = Some(line_of(call.method.span()));
            }
            syn::visit::visit_expr_method_call(self, call);
        }
        fn visit_item_impl(&mut self, item: &'a syn::ItemImpl) {
            let module = item.trait_.as_ref().is_some_and(|(_, path, _)| {
                path.segments
                    .last()
                    .is_some_and(|s| s.ident == "Module" || s.ident == "ModuleT")
            });
            if module && self.struct_model.is_none() {
                if let syn::Type::Path(ty) = &*item.self_ty {
                    self.struct_model = ty.path.segments.last().map(|s| s.ident.to_string());
                }
            }
            // Calls inside impls are definitions, not the model running.
        }
    }
    let mut finder = Finder::default();
    finder.visit_block(block);
    (finder.forward, finder.struct_model)
}
