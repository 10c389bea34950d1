//! Activation checkpointing: models built with `nn::seq()` / `nn::seq_t()` in the cell are built
//! with `tchmem::checkpoint::seq()` / `seq_t()` instead, which keep only the inputs of each
//! segment and recompute the rest in the backward pass.

use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::visit_mut::{self, VisitMut};
use syn::{Block, Expr};

use super::cell::line_of;
use super::change::Change;
use super::earlier::{ModelKind, ModelOrigin};
use super::span::FORWARD_METHODS;
use super::syntax::{as_ident, as_ref_ident, is_nn_path, strip_parens};
use super::{Compress, Refusal};

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

/// Rewrites every `nn::seq()`/`nn::seq_t()` builder in the cell. `models` are the models of
/// earlier cells the cell uses that cannot be rebuilt: a refusal says what they are.
pub(crate) fn apply(
    block: &mut Block,
    segments: Option<u32>,
    keep: Keep,
    models: &[ModelOrigin],
    changes: &mut Vec<Change>,
) -> Result<(), Refusal> {
    if let Some(call) = every_layers_output(block) {
        return Err(Refusal::new(
            format!(
                "--checkpoint would save nothing here: the loop takes every layer's output of \
                 `{model}` (`{model}.{method}(…)`), and the loss keeps them, so the activations \
                 that checkpointing recomputes are held anyway. Checkpointing helps a loop whose \
                 loss takes the model's last output (`xs.apply_t(&{model}, train)`).",
                model = call.model,
                method = call.method,
            ),
            Some(call.line),
        ));
    }
    let mut rewriter = Rewriter {
        segments,
        keep,
        found: Vec::new(),
    };
    rewriter.visit_block_mut(block);
    if rewriter.found.is_empty() {
        let hints = model_hints(block);
        let known = hints
            .models
            .iter()
            .find_map(|name| models.iter().find(|m| &m.name == name))
            .map(why_not)
            .or_else(|| hints.struct_model.as_deref().map(why_not_struct));
        let message = match known {
            Some(why) => format!(
                "--checkpoint cannot checkpoint {why} (--checkpoint rewrites models built with \
                 nn::seq() or nn::seq_t() in this cell, or by earlier cells and their functions)"
            ),
            None => "--checkpoint looks for a model built with nn::seq() or nn::seq_t() in \
                     this cell, or by a `let` of an earlier cell (and the functions of earlier \
                     cells it calls) that the cell uses; found none. A model of another kind is \
                     checkpointed where it is built: its layers in tchmem::checkpoint::seq() or \
                     seq_t() (as nn::seq() / nn::seq_t())."
                .to_string(),
        };
        return Err(Refusal::new(message, hints.forward));
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
        if keep.offload {
            changes.push(Change::at(
                *line,
                "--offload: `.offload()`: each segment's input (all checkpointing keeps) goes to \
                 pinned host memory on a side stream once the segment has run, and comes back \
                 one segment ahead of its rerun in backward",
            ));
        }
        if let Some(compress) = keep.compress {
            changes.push(Change::at(
                *line,
                format!(
                    "--compress-activations {}: `.compress(…)`: each segment's input is kept in \
                     8 bits with a scale per row and dequantized for its rerun (the gradients \
                     see the rounded input)",
                    compress.flag_value()
                ),
            ));
        }
    }
    Ok(())
}

/// A call that returns every layer's output of a model the cell checkpoints.
struct EveryLayersOutput {
    line: usize,
    /// The model's variable (`net`).
    model: String,
    /// `forward_all` or `forward_all_t`.
    method: String,
}

/// The first call that returns every layer's output (`net.forward_all_t(&xs, train, n)`, as a
/// style transfer takes them) of a model built with `nn::seq()`/`nn::seq_t()` in the block (or
/// brought into it from an earlier cell): the one `--checkpoint` would rewrite. A network whose
/// layers only feed a loss (a perceptual loss's vgg) is not the model checkpointed.
fn every_layers_output(block: &Block) -> Option<EveryLayersOutput> {
    let checkpointed: Vec<String> = block
        .stmts
        .iter()
        .filter(|stmt| builds_seq(stmt))
        .flat_map(super::syntax::let_bindings)
        .map(|binding| binding.ident.to_string())
        .collect();
    struct Finder<'c> {
        checkpointed: &'c [String],
        found: Option<EveryLayersOutput>,
    }
    impl<'a> Visit<'a> for Finder<'_> {
        fn visit_expr_method_call(&mut self, call: &'a syn::ExprMethodCall) {
            let every = call.method == "forward_all" || call.method == "forward_all_t";
            let model = as_ident(&call.receiver).map(|ident| ident.to_string());
            if let (true, None, Some(model)) = (every, &self.found, model) {
                if self.checkpointed.contains(&model) {
                    self.found = Some(EveryLayersOutput {
                        line: line_of(call.method.span()),
                        model,
                        method: call.method.to_string(),
                    });
                }
            }
            syn::visit::visit_expr_method_call(self, call);
        }
        fn visit_item(&mut self, _: &'a syn::Item) {}
    }
    let mut finder = Finder {
        checkpointed: &checkpointed,
        found: None,
    };
    finder.visit_block(block);
    finder.found
}

/// Where the rewritten model keeps its segments' inputs (`--offload`, `--compress-activations`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Keep {
    pub offload: bool,
    pub compress: Option<Compress>,
}

struct Rewriter {
    segments: Option<u32>,
    keep: Keep,
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
        if self.keep.offload {
            *expr = syn::parse_quote!(#expr.offload());
        }
        if let Some(compress) = self.keep.compress {
            let variant =
                proc_macro2::Ident::new(compress.runtime_variant(), proc_macro2::Span::call_site());
            *expr = syn::parse_quote!(#expr.compress(tchmem::checkpoint::Compression::#variant));
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

/// Why a model of an earlier cell cannot be checkpointed, and what would let it (after
/// "cannot checkpoint").
fn why_not(model: &ModelOrigin) -> String {
    let (name, run) = (&model.name, model.run);
    match &model.kind {
        ModelKind::Struct {
            name: ty,
            run: impl_run,
        } => format!(
            "`{name}` (cell [{run}]): it is a `{ty}`, a struct (its forward in cell \
             [{impl_run}]) whose layers are its fields, out of reach of a rewrite of the loop. \
             {}",
            struct_fix(ty)
        ),
        ModelKind::Recurrent { function } => format!(
            "`{name}` (cell [{run}]): an nn::{function} runs the whole sequence in one call, \
             with no layers to recompute one by one, and recomputing the call whole keeps what \
             it saves. --amp bf16 and --accumulate reduce this loop's activations."
        ),
        ModelKind::Library { function } => format!(
            "`{name}` (cell [{run}]): it is built by `{function}`, a function the notebook did \
             not define, and either its source was not found among the cells' dependencies \
             (the kernel's log says what cargo answered) or it builds no nn::seq() or \
             nn::seq_t(). Paste the function's code into a cell with its layers in \
             nn::seq_t() (tch::vision's resnet, vgg, densenet, alexnet, squeezenet, mobilenet \
             and inception models build theirs so, and --checkpoint rebuilds them from tch's \
             source)."
        ),
        ModelKind::InParts { store, others } => format!(
            "`{name}` (cell [{run}]): it shares its VarStore `{store}` with {}, and \
             --checkpoint rebuilds a model on a store of its own, with the optimizer on that \
             store, which would leave the other parts out of training. Build `{name}` on a \
             store of its own (as tch-rs's transfer-learning example builds its backbone), and \
             the other parts and their optimizer on another. (A frozen backbone whose input \
             takes no gradient keeps no activations for the backward pass: checkpointing it \
             saves nothing.)",
            others
                .iter()
                .map(|other| format!("`{other}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Why a struct model of this cell cannot be checkpointed, and what would let it.
fn why_not_struct(ty: &str) -> String {
    format!(
        "`{ty}` (a struct implementing Module in this cell): its layers are its fields, out of \
         reach of a rewrite of the loop. {}",
        struct_fix(ty)
    )
}

/// The change that lets a struct model be checkpointed.
fn struct_fix(ty: &str) -> String {
    format!(
        "To checkpoint it, hold the layers its forward runs one after another in one field \
         built with tchmem::checkpoint::seq_t() in `{ty}`'s constructor (`.add(layer)`, and \
         `.add_fn(|x| …)` for what runs between layers) and apply that field in the forward \
         (`xs.apply_t(&self.layers, train)`): the model is then checkpointed wherever it runs."
    )
}

/// Where and what the model the cell runs is, for the refusal.
#[derive(Default)]
struct ModelHints {
    /// The line of the first forward call.
    forward: Option<usize>,
    /// The variables the forward calls run (`net` of `net.forward_t(..)` or `xs.apply_t(&net,
    /// ..)`), in the order they run: a chain's innermost call first.
    models: Vec<String>,
    /// A struct implementing `Module`/`ModuleT` in the cell.
    struct_model: Option<String>,
}

fn model_hints(block: &Block) -> ModelHints {
    struct Finder(ModelHints);
    impl<'a> Visit<'a> for Finder {
        fn visit_expr_method_call(&mut self, call: &'a syn::ExprMethodCall) {
            let forward = FORWARD_METHODS.iter().any(|m| call.method == m);
            if forward && self.0.forward.is_none() {
                self.0.forward = Some(line_of(call.method.span()));
            }
            // The receiver runs first: its calls go before this one's model.
            syn::visit::visit_expr_method_call(self, call);
            if forward {
                let model = if call.method == "apply" || call.method == "apply_t" {
                    call.args.first().and_then(as_ref_ident)
                } else {
                    as_ident(&call.receiver)
                };
                self.0.models.extend(model.map(|ident| ident.to_string()));
            }
        }
        fn visit_item_impl(&mut self, item: &'a syn::ItemImpl) {
            let module = item.trait_.as_ref().is_some_and(|(_, path, _)| {
                path.segments
                    .last()
                    .is_some_and(|s| s.ident == "Module" || s.ident == "ModuleT")
            });
            if module && self.0.struct_model.is_none() {
                if let syn::Type::Path(ty) = &*item.self_ty {
                    self.0.struct_model = ty.path.segments.last().map(|s| s.ident.to_string());
                }
            }
            // Calls inside impls are definitions, not the model running.
        }
    }
    let mut finder = Finder(ModelHints::default());
    finder.visit_block(block);
    finder.0
}
