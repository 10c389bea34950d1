//! `--step-in-backward`: the optimizer the cell builds becomes one that updates each parameter
//! inside backward, as soon as its gradient is complete, and frees that gradient
//! (`tchmem::optim::Optimizer::in_backward`). tch's Adam, AdamW and Sgd go through tchmem's with
//! the same settings; the loop itself is unchanged (`step` and `zero_grad` find nothing left).

use proc_macro2::Ident;
use syn::visit::{self, Visit};
use syn::visit_mut::{self, VisitMut};
use syn::{Block, Expr};

use super::cell::line_of;
use super::change::Change;
use super::earlier::UnknownOptimizer;
use super::optimizer::{self, as_build, imports_nn_optimizer, Config};
use super::syntax::{as_ident, is_nn_path};
use super::tree::Tree;
use super::Refusal;

const FLAG: &str = "--step-in-backward";

/// Optimizer methods that need every gradient before any step, and why. `backward_step_clip`
/// (by value, per element) is not one: the step in backward clips each gradient before its
/// step.
const NEEDS_EVERY_GRADIENT: [(&str, &str); 3] = [
    (
        "clip_grad_norm",
        "clipping by the global norm needs every gradient before the first step",
    ),
    (
        "backward_step_clip_norm",
        "clipping by the global norm needs every gradient before the first step",
    ),
    (
        "clip_grad_value",
        "clipping comes after backward, when the steps were already taken in it",
    ),
];

/// The `tchmem::optim` type that does tch's config `name`'s update, if there is one.
fn counterpart(name: &str) -> Option<&'static str> {
    match name {
        "Adam" | "adam" => Some("Adam"),
        "AdamW" | "adamw" => Some("AdamW"),
        "Sgd" | "sgd" => Some("Sgd"),
        _ => None,
    }
}

/// Makes every optimizer built in the cell step inside backward.
pub(crate) fn apply(
    block: &mut Block,
    unknown: &[UnknownOptimizer],
    changes: &mut Vec<Change>,
) -> Result<(), Refusal> {
    let tree = Tree::of(block);
    let found = optimizer::builds(&tree);
    if found.is_empty() {
        let step = super::step::the_step(&tree, FLAG).ok();
        let line = step.as_ref().map(|s| s.line);
        let message = match optimizer::stepped_unknown(step.as_ref(), unknown) {
            Some(optimizer) => format!(
                "{FLAG}: the training step's optimizer is {}, {}: its update runs over every \
                 parameter at once in its own `step`, which cannot be taken apart per parameter; \
                 it steps tch's optimizers (`nn::AdamW::default().build(&vs, lr)`, Adam, Sgd) and \
                 tchmem::optim's in backward.",
                optimizer.described(),
                optimizer.origin()
            ),
            None => format!(
                "{FLAG} looks for the optimizer the loop steps, built in this cell or an \
                 earlier one (`nn::AdamW::default().build(&vs, lr)`, Adam, Sgd, or one of \
                 tchmem::optim's); found none{}.",
                optimizer::used_at_step(step.as_ref())
            ),
        };
        return Err(Refusal::new(message, line));
    }
    for build in &found {
        if let Config::Nn { name, .. } = &build.config {
            if counterpart(name).is_none() {
                return Err(Refusal::at(
                    build.line,
                    format!(
                        "{FLAG}: tch's {name} has no counterpart in tchmem::optim to step one \
                         parameter at a time (Adam, AdamW and Sgd have); add --optimizer \
                         sgd|lion|adamw8bit|adafactor, or leave {FLAG} out"
                    ),
                ));
            }
        }
    }
    let variables: Vec<Ident> = found.iter().filter_map(|b| b.binding.clone()).collect();
    if let Some((variable, method, why, line)) = needs_every_gradient(block, &variables) {
        return Err(Refusal::at(
            line,
            format!(
                "{FLAG}: `{variable}.{method}(…)`: {why}. Remove the clipping, or leave {FLAG} \
                 out"
            ),
        ));
    }
    if let Some((read, line)) = gradient_read(block) {
        return Err(Refusal::at(
            line,
            format!(
                "{FLAG}: `{read}.grad()` reads a gradient, which the step in backward frees as \
                 soon as its parameter has stepped (it would read an undefined tensor). Remove \
                 the read, or leave {FLAG} out"
            ),
        ));
    }
    if let Some((variable, method, line)) = conditional_step(block, &variables) {
        return Err(Refusal::at(
            line,
            format!(
                "{FLAG}: `{variable}.{method}(…)` runs under a condition, as when gradients are \
                 added up over several backward passes by hand; the step in backward would step \
                 at every one of them. Leave {FLAG} out (or let --accumulate do the adding up)"
            ),
        ));
    }
    if let Some((variable, method, line)) = optimizer::unsupported_call(block, &variables) {
        return Err(Refusal::at(
            line,
            format!(
                "{FLAG}: `{variable}.{method}(…)` has no equivalent on tchmem::optim::InBackward \
                 (it has backward_step, step, zero_grad, set_lr, set_lr_group, \
                 set_weight_decay, set_weight_decay_group); remove the call or leave {FLAG} out"
            ),
        ));
    }
    for build in &found {
        let what = match &build.config {
            Config::Nn { name, .. } => {
                let ours = counterpart(name).unwrap_or("AdamW");
                format!("nn::{name} → tchmem::optim::{ours}::from(…) (the same settings), ")
            }
            Config::Tchmem(_) => String::new(),
        };
        changes.push(Change::at(
            build.line,
            format!(
                "{FLAG}: {what}stepped in backward (`.in_backward()`): each parameter is updated \
                 as soon as its gradient is complete and the gradient freed, so the model's \
                 gradients never all live at once; `step()`/`zero_grad()` find nothing left"
            ),
        ));
    }
    drop(tree);
    let mut wrapper = Wrapper {
        fix_bare: imports_nn_optimizer(block),
    };
    wrapper.visit_block_mut(block);
    Ok(())
}

/// The first call on an optimizer variable that needs every gradient at once, with why.
fn needs_every_gradient(
    block: &Block,
    variables: &[Ident],
) -> Option<(Ident, String, &'static str, usize)> {
    optimizer::first_call_on(block, variables, |method| {
        NEEDS_EVERY_GRADIENT
            .iter()
            .find(|(name, _)| *name == method)
            .map(|(_, why)| *why)
    })
}

/// The first `x.grad()` in the cell (a gradient read for logging, a norm by hand), and its line.
fn gradient_read(block: &Block) -> Option<(String, usize)> {
    struct Finder(Option<(String, usize)>);
    impl<'a> Visit<'a> for Finder {
        fn visit_expr_method_call(&mut self, call: &'a syn::ExprMethodCall) {
            if self.0.is_none() && call.method == "grad" && call.args.is_empty() {
                let receiver = quote::ToTokens::to_token_stream(&*call.receiver)
                    .to_string()
                    .replace(' ', "");
                self.0 = Some((receiver, line_of(call.method.span())));
            }
            visit::visit_expr_method_call(self, call);
        }
    }
    let mut finder = Finder(None);
    finder.visit_block(block);
    finder.0
}

/// The first `step`/`backward_step` of an optimizer variable inside an `if` (a step taken every
/// few backward passes).
fn conditional_step(block: &Block, variables: &[Ident]) -> Option<(Ident, String, usize)> {
    struct Finder<'v> {
        variables: &'v [Ident],
        in_branch: usize,
        found: Option<(Ident, String, usize)>,
    }
    impl<'a> Visit<'a> for Finder<'_> {
        fn visit_expr_if(&mut self, e: &'a syn::ExprIf) {
            self.visit_expr(&e.cond);
            self.in_branch += 1;
            self.visit_block(&e.then_branch);
            if let Some((_, otherwise)) = &e.else_branch {
                self.visit_expr(otherwise);
            }
            self.in_branch -= 1;
        }
        fn visit_expr_method_call(&mut self, call: &'a syn::ExprMethodCall) {
            let method = call.method.to_string();
            let steps = matches!(method.as_str(), "step" | "backward_step");
            if let (true, true, Some(receiver), None) = (
                steps,
                self.in_branch > 0,
                as_ident(&call.receiver),
                &self.found,
            ) {
                if self.variables.contains(receiver) {
                    let line = line_of(call.method.span());
                    self.found = Some((receiver.clone(), method, line));
                }
            }
            visit::visit_expr_method_call(self, call);
        }
    }
    let mut finder = Finder {
        variables,
        in_branch: 0,
        found: None,
    };
    finder.visit_block(block);
    finder.found
}

/// Wraps each build in `.map(tchmem::optim::Optimizer::in_backward)` (tch's configs first
/// through tchmem's), and makes optimizer type annotations `tchmem::optim::InBackward`.
struct Wrapper {
    /// A bare `Optimizer` is tch's (the cell imports it).
    fix_bare: bool,
}

impl VisitMut for Wrapper {
    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        visit_mut::visit_expr_mut(self, expr);
        let Some((_, config)) = as_build(expr) else {
            return;
        };
        if let (Config::Nn { name, .. }, Expr::MethodCall(call)) = (&config, &mut *expr) {
            let ours = Ident::new(
                counterpart(name).unwrap_or("AdamW"),
                proc_macro2::Span::call_site(),
            );
            let config = &call.receiver;
            *call.receiver = syn::parse_quote!(tchmem::optim::#ours::from(#config));
        }
        *expr = syn::parse_quote!(#expr.map(tchmem::optim::Optimizer::in_backward));
    }

    fn visit_type_path_mut(&mut self, ty: &mut syn::TypePath) {
        visit_mut::visit_type_path_mut(self, ty);
        if ty.qself.is_some() {
            return;
        }
        let path = &ty.path;
        let tchmem_optimizer = super::syntax::segments(path)
            .iter()
            .map(String::as_str)
            .eq(["tchmem", "optim", "Optimizer"]);
        if tchmem_optimizer
            || is_nn_path(path, &["Optimizer"])
            || (self.fix_bare && path.is_ident("Optimizer"))
        {
            ty.path = syn::parse_quote!(tchmem::optim::InBackward);
        }
    }
}
