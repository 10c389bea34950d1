//! Finding the training step: `opt.backward_step(&loss)`, or `loss.backward()` then
//! `opt.step()` (with `opt.zero_grad()` somewhere in the same block), and the forms tchmem's own
//! rewrites leave behind (so that `--compare` can instrument a rewritten cell).

use proc_macro2::Ident;
use quote::ToTokens;
use syn::spanned::Spanned;
use syn::{Expr, ExprMethodCall, Stmt};

use super::cell::line_of;
use super::syntax::{as_ident, as_mut_ref_ident, as_ref_ident, binds};
use super::tree::Tree;
use super::{describe_lines, Refusal};

/// What to describe when no step is found.
pub(crate) const STEP_PATTERN: &str = "the training step: `opt.backward_step(&loss)`, or \
     `loss.backward()` followed by `opt.step()`";

/// Gradient clipping done by `backward_step_clip` (values) or `backward_step_clip_norm`.
#[derive(Clone)]
pub(crate) enum Clip {
    Value(Box<Expr>),
    Norm(Box<Expr>),
}

/// How the step is written.
#[derive(Clone)]
pub(crate) enum Form {
    /// `opt.backward_step(loss)` or a clipping variant.
    Combined { clip: Option<Clip> },
    /// `loss.backward();` at statement `backward`, then `opt.step();`, with `opt.zero_grad();`
    /// at statement `zero_grad` of the same block if there is one.
    Split {
        backward: usize,
        zero_grad: Option<usize>,
    },
    /// Already rewritten by tchmem: `scaler.backward_step(&mut opt, &loss)`,
    /// `scaler.step(&mut opt)`, or `opt.step()` after an accumulated loss.
    Rewritten,
}

/// The loss the step differentiates.
#[derive(Clone)]
pub(crate) enum Loss {
    /// A variable.
    Var(Ident),
    /// An expression written inside the `backward_step(…)` call (without a leading `&`).
    Inline(Box<Expr>),
}

/// A training step.
#[derive(Clone)]
pub(crate) struct Step {
    /// The block holding it (an index into the [`Tree`]).
    pub block: usize,
    /// Its statement's index in that block.
    pub index: usize,
    /// The optimizer variable.
    pub opt: Ident,
    pub loss: Loss,
    pub form: Form,
    /// Its line in the cell.
    pub line: usize,
}

/// The method call a statement consists of (`x.f(…);`).
pub(crate) fn method_call(stmt: &Stmt) -> Option<&ExprMethodCall> {
    match stmt {
        Stmt::Expr(Expr::MethodCall(call), _) => Some(call),
        _ => None,
    }
}

/// `receiver.method()` with no arguments, as a statement.
fn is_call_on(stmt: &Stmt, receiver: &Ident, method: &str) -> bool {
    method_call(stmt).is_some_and(|call| {
        call.method == method && call.args.is_empty() && as_ident(&call.receiver) == Some(receiver)
    })
}

/// Every training step in the cell.
pub(crate) fn find_all(tree: &Tree) -> Vec<Step> {
    let mut steps = Vec::new();
    for (block_id, info) in tree.blocks.iter().enumerate() {
        let stmts = &info.block.stmts;
        for (index, stmt) in stmts.iter().enumerate() {
            if let Some(step) = recognise(stmts, index, stmt) {
                steps.push(Step {
                    block: block_id,
                    index,
                    line: line_of(stmt.span()),
                    ..step
                });
            }
        }
    }
    // `loss.backward(); opt.step(); scheduler.step();` is one step: of several `x.step()` after
    // the same backward pass, keep the optimizer's (the one that also has `zero_grad`).
    let mut kept: Vec<Step> = Vec::new();
    for step in steps {
        let Form::Split {
            backward,
            zero_grad,
        } = step.form
        else {
            kept.push(step);
            continue;
        };
        let same = kept.iter().position(|k| {
            k.block == step.block
                && matches!(k.form, Form::Split { backward: b, .. } if b == backward)
        });
        match same {
            None => kept.push(step),
            Some(i) => {
                let had_zero_grad = matches!(
                    kept[i].form,
                    Form::Split {
                        zero_grad: Some(_),
                        ..
                    }
                );
                if !had_zero_grad && zero_grad.is_some() {
                    kept[i] = step;
                }
            }
        }
    }
    kept
}

fn recognise(stmts: &[Stmt], index: usize, stmt: &Stmt) -> Option<Step> {
    let call = method_call(stmt)?;
    let receiver = as_ident(&call.receiver)?.clone();
    let args: Vec<&Expr> = call.args.iter().collect();
    let step = |opt: Ident, loss: Loss, form: Form| Step {
        block: 0,
        index,
        opt,
        loss,
        form,
        line: 0,
    };
    let method = call.method.to_string();
    match (method.as_str(), args.as_slice()) {
        ("backward_step", [opt, loss]) => {
            let opt = as_mut_ref_ident(opt)?.clone();
            let loss = as_ref_ident(loss)?.clone();
            Some(step(opt, Loss::Var(loss), Form::Rewritten))
        }
        ("backward_step" | "backward_step_clip" | "backward_step_clip_norm", [loss, rest @ ..]) => {
            let clip = match (method.as_str(), rest) {
                ("backward_step", []) => None,
                ("backward_step_clip", [max]) => Some(Clip::Value(Box::new((*max).clone()))),
                ("backward_step_clip_norm", [max]) => Some(Clip::Norm(Box::new((*max).clone()))),
                _ => return None,
            };
            let loss = match as_ref_ident(loss) {
                Some(ident) => Loss::Var(ident.clone()),
                None => Loss::Inline(Box::new(match loss {
                    Expr::Reference(r) if r.mutability.is_none() => (*r.expr).clone(),
                    other => (*other).clone(),
                })),
            };
            Some(step(receiver, loss, Form::Combined { clip }))
        }
        ("step", []) => {
            let before = &stmts[..index];
            let backward = before.iter().rposition(|s| {
                method_call(s).is_some_and(|c| {
                    c.method == "backward" && c.args.is_empty() && as_ident(&c.receiver).is_some()
                })
            });
            if let Some(backward) = backward {
                let loss = as_ident(&method_call(&before[backward])?.receiver)?.clone();
                let zero_grad = stmts
                    .iter()
                    .position(|s| is_call_on(s, &receiver, "zero_grad"));
                return Some(step(
                    receiver,
                    Loss::Var(loss),
                    Form::Split {
                        backward,
                        zero_grad,
                    },
                ));
            }
            let loss = accumulated_loss(before)?;
            Some(step(receiver, Loss::Var(loss), Form::Rewritten))
        }
        ("step", [opt]) => {
            let opt = as_mut_ref_ident(opt)?.clone();
            let loss = accumulated_loss(&stmts[..index])?;
            Some(step(opt, Loss::Var(loss), Form::Rewritten))
        }
        _ => None,
    }
}

/// The variable of the last `let x = …;` in `stmts` whose value runs a backward pass (what the
/// accumulation rewrite leaves before the step).
fn accumulated_loss(stmts: &[Stmt]) -> Option<Ident> {
    stmts.iter().rev().find_map(|stmt| match stmt {
        Stmt::Local(local) => {
            let init = local.init.as_ref()?;
            let text = init.expr.to_token_stream().to_string();
            if !text.contains(". backward ()") {
                return None;
            }
            match &local.pat {
                syn::Pat::Ident(p) => Some(p.ident.clone()),
                _ => None,
            }
        }
        _ => None,
    })
}

/// The one training step of the cell, or why there is not exactly one.
pub(crate) fn the_step(tree: &Tree, flag: &str) -> Result<Step, Refusal> {
    let steps = find_all(tree);
    match steps.as_slice() {
        [] => Err(Refusal::new(
            format!("{flag} looks for {STEP_PATTERN}; this cell has neither."),
            None,
        )),
        [step] => Ok(step.clone()),
        [first, second, ..] => {
            // Named through the refusal, so that the line moves with it below a magic line or
            // after code brought from earlier cells.
            let first_at = describe_lines((first.line, first.line));
            let found = format!(
                "{flag} found {} training steps (the first at {first_at}, the second here)",
                steps.len()
            );
            let outermost = |step: &Step| tree.loops(step.block).last().copied();
            let one_loop = outermost(first).is_some() && outermost(first) == outermost(second);
            let why = if one_loop && first.opt != second.opt {
                ": a loop that steps several optimizers in turn (a GAN's discriminator and \
                 generator) is not one it can rewrite or time step by step."
            } else if one_loop {
                ": it rewrites a loop with one training step."
            } else {
                "; it rewrites cells with one training loop. Put each loop in its own cell."
            };
            Err(Refusal::naming(
                second.line,
                (first.line, first.line),
                format!("{found}{why}"),
            ))
        }
    }
}

/// The index of the last statement before `limit` in `stmts` that binds `loss` with `let`.
pub(crate) fn loss_binding(stmts: &[Stmt], limit: usize, loss: &Ident) -> Option<usize> {
    stmts[..limit.min(stmts.len())]
        .iter()
        .rposition(|stmt| binds(stmt, loss))
}
