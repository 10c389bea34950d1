//! Phase markers: a rewritten training step is marked with `tchmem::phase` calls (forward,
//! backward, optimizer step, end), so that the cell's memory record tells optimizer state and
//! activations apart and a `%%memprofile` timeline shows the phases. A cell that already calls
//! `tchmem::phase` keeps its own markers.
//!
//! tch's `opt.backward_step(&loss)` is spelled out (`opt.zero_grad(); loss.backward();
//! opt.step();`, what it does) so that the optimizer step is a phase of its own; the runtime's
//! `scaler.backward_step(&mut opt, &loss)` marks its step itself.

use proc_macro2::TokenStream;
use quote::quote;
use syn::{Block, Stmt};

use super::span::ForwardSpan;
use super::step::{self, method_call, Clip, Form, Loss, Step};
use super::syntax::{as_ident, stmts, Names};
use super::training::hoist_loss;
use super::tree::{edit_block, Tree};
use super::{Change, Refusal};

/// The flag name used in (internal) refusals.
const FLAG: &str = "phase markers";

/// The statements that replace the step statement, with its markers. `in_backward`: the
/// optimizer steps inside backward, where it also clips by value (`backward_step_clip` stays
/// one call; spelled out, its clipping would come after the steps).
fn marked_step(step: &Step, stmt: &Stmt, in_backward: bool) -> TokenStream {
    let opt = &step.opt;
    let loss = match &step.loss {
        Loss::Var(loss) => quote!(#loss),
        Loss::Inline(expr) => quote!((#expr)),
    };
    match &step.form {
        Form::Combined {
            clip: Some(Clip::Value(_)),
        } if in_backward => quote! {
            tchmem::phase::backward();
            #stmt
            tchmem::phase::end();
        },
        Form::Combined { clip } => {
            let clip = match clip {
                Some(Clip::Value(max)) => quote!(#opt.clip_grad_value(#max);),
                Some(Clip::Norm(max)) => quote!(#opt.clip_grad_norm(#max);),
                None => quote!(),
            };
            quote! {
                tchmem::phase::backward();
                #opt.zero_grad();
                #loss.backward();
                #clip
                tchmem::phase::step();
                #opt.step();
                tchmem::phase::end();
            }
        }
        Form::Rewritten => {
            let call = method_call(stmt);
            let scaler = call
                .filter(|c| c.method == "backward_step")
                .and_then(|c| as_ident(&c.receiver));
            match scaler {
                // GradScaler::step marks the optimizer step.
                Some(scaler) if scaler != opt => quote! {
                    tchmem::phase::backward();
                    #stmt
                    tchmem::phase::end();
                },
                // `scaler.step(&mut opt)` or `opt.step()` after accumulated micro-batches, whose
                // loop marks its own forward and backward passes.
                _ => quote! {
                    tchmem::phase::step();
                    #stmt
                    tchmem::phase::end();
                },
            }
        }
        Form::Split { .. } => quote! {
            tchmem::phase::step();
            #stmt
            tchmem::phase::end();
        },
    }
}

/// Marks the phases of the training step in `block` (see the module's doc). A cell without a
/// step the rewriter recognises is left as it is.
/// `line` is the step's line in the cell (the rewritten code's lines are not the cell's).
pub(crate) fn mark(
    block: &mut Block,
    line: Option<usize>,
    names: &mut Names,
    changes: &mut Vec<Change>,
) -> Result<(), Refusal> {
    let Ok(mut step) = step::the_step(&Tree::of(block), FLAG) else {
        return Ok(());
    };
    if let (Loss::Inline(expr), Form::Combined { .. }) = (&step.loss, &step.form) {
        // The loss gets a name first, so that its forward pass is marked as such.
        let expr = (**expr).clone();
        hoist_loss(block, &step, expr, names, &mut Vec::new())?;
        step = step::the_step(&Tree::of(block), FLAG)?;
    }
    let tree = Tree::of(block);
    let step_block = tree.blocks[step.block].block;
    let forward_at = ForwardSpan::find(step_block, &step, FLAG).map_or(0, |span| span.start);
    let backward_at = match step.form {
        Form::Split { backward, .. } => Some(backward),
        _ => None,
    };
    let in_backward = super::syntax::stmts_mention(&block.stmts, "in_backward");
    let replacement = stmts(marked_step(
        &step,
        &step_block.stmts[step.index],
        in_backward,
    ))?;
    let target: *const Block = step_block;
    let index = step.index;
    drop(tree);
    edit_block(block, target, |b| {
        // From the last position to the first, so that earlier indices stay right.
        b.stmts.splice(index..=index, replacement);
        if let Some(at) = backward_at {
            b.stmts.splice(
                at..at,
                stmts(quote!(tchmem::phase::backward();)).unwrap_or_default(),
            );
        }
        // A loss computed in a micro-batch loop (accumulation) is marked inside it.
        let already = b.stmts[forward_at..].first().is_some_and(|s| {
            quote::ToTokens::to_token_stream(s)
                .to_string()
                .contains("tchmem :: accumulate")
        });
        if !already {
            b.stmts.splice(
                forward_at..forward_at,
                stmts(quote!(tchmem::phase::forward();)).unwrap_or_default(),
            );
        }
    });
    let what =
        "phases marked (tchmem::phase: forward, backward, optimizer step), so that the cell's \
         record tells activations and optimizer state apart and %%memprofile shows the phases";
    changes.push(match line {
        Some(line) => Change::at(line, what),
        None => Change::general(what),
    });
    Ok(())
}
