//! `--compare`: instruments a cell so that it records each optimizer step's loss and stops after
//! the number of steps the runtime was given.

use proc_macro2::TokenTree;
use quote::quote;
use syn::{Block, Stmt};

use super::cell;
use super::step::{self, Loss};
use super::syntax::{stmts, tchmem_modules, Names};
use super::training::hoist_loss;
use super::tree::{edit_block, label_loop, Role, Tree};
use super::Refusal;

/// The label given to the outermost training loop, when it has none.
const LABEL: &str = "'tchmem_train";

/// Instruments `src`; see [`super::instrument_for_compare`].
pub(crate) fn instrument(src: &str) -> Result<String, Refusal> {
    let cell = cell::parse(src)?;
    let mut block = cell.block.clone();
    if tchmem_modules(&block).contains("compare") {
        return Err(Refusal::new(
            "--compare: the cell already calls tchmem::compare; instrument the cell without it",
            None,
        ));
    }
    let step = step::the_step(&Tree::of(&block), "--compare")?;
    if let Loss::Inline(expr) = &step.loss {
        // `opt.backward_step(&<expr>)`: the loss gets a name, so that it can be recorded.
        let mut names = Names::of(&block);
        hoist_loss(
            &mut block,
            &step,
            (**expr).clone(),
            &mut names,
            &mut Vec::new(),
        )?;
    }
    let tree = Tree::of(&block);
    let step = step::the_step(&tree, "--compare")?;
    let Loss::Var(loss) = &step.loss else {
        return Err(Refusal::at(
            step.line,
            "internal error: the loss is still not in a variable",
        ));
    };
    let loops = tree.loops(step.block);
    let (Some(&innermost), Some(&outermost)) = (loops.first(), loops.last()) else {
        return Err(Refusal::at(
            step.line,
            "--compare looks for the training step inside a `for`, `while` or `loop` loop (in \
             the same function), to stop it after the compared steps; this step is in none",
        ));
    };
    let Role::Loop(outer_loop) = tree.blocks[outermost].role else {
        return Err(Refusal::new(
            "internal error: a loop body without its loop",
            None,
        ));
    };
    let label: syn::Label = match outer_loop.label() {
        Some(label) => label.clone(),
        None => syn::parse_str(&format!("{LABEL}:"))
            .map_err(|e| Refusal::new(format!("internal error: {e}"), None))?,
    };
    let name = &label.name;
    let record = stmts(quote! {
        if tchmem::compare::record_step(&#loss) {
            break #name;
        }
    })?;

    // At the end of the loop body, so that what follows the step runs for the last one too,
    // unless the loss is not there (the step is nested deeper, or the loss is moved or
    // rebound after it) or the end may not be reached (a `continue` or `break` after the step,
    // e.g. logging every N steps): then right after the step.
    let step_block = &tree.blocks[step.block].block;
    let after = &step_block.stmts[step.index + 1..];
    let at_end = step.block == innermost && !moves_or_rebinds(after, loss) && !leaves_early(after);
    let at = if at_end {
        step_block.stmts.len()
    } else {
        step.index + 1
    };
    let target: *const Block = tree.blocks[step.block].block;
    let loop_body: *const Block = tree.blocks[outermost].block;
    let step_loop_body: *const Block = tree.blocks[innermost].block;
    let needs_label = outer_loop.label().is_none();
    let rewritten = !tchmem_modules(&block).is_empty();
    drop(tree);

    if needs_label {
        label_loop(&mut block, loop_body, &label);
    }
    edit_block(&mut block, target, |b| {
        // What comes before the new statement cannot stay a block's tail expression.
        if let Some(Stmt::Expr(_, semi @ None)) = b.stmts.get_mut(at.wrapping_sub(1)) {
            *semi = Some(Default::default());
        }
        b.stmts.splice(at..at, record);
    });
    // Where a step begins, what the last one left is read ("kept across steps").
    let begins = stmts(quote! { tchmem::compare::step_begins(); })?;
    edit_block(&mut block, step_loop_body, |b| {
        b.stmts.splice(0..0, begins);
    });
    let header = format!(
        "%%optimize --compare: the {} cell, instrumented by tchmem to stop after the compared \
         steps",
        if rewritten { "rewritten" } else { "original" }
    );
    Ok(cell::print(&cell, &block, &header))
}

/// Whether `stmts` hold a `continue`, `break` or `return` (at any depth: one in a nested loop
/// may be harmless, but right after the step is always safe).
fn leaves_early(stmts: &[Stmt]) -> bool {
    fn check(tokens: proc_macro2::TokenStream) -> bool {
        tokens.into_iter().any(|tree| match tree {
            TokenTree::Ident(ident) => ident == "continue" || ident == "break" || ident == "return",
            TokenTree::Group(group) => check(group.stream()),
            _ => false,
        })
    }
    stmts
        .iter()
        .any(|stmt| check(quote::ToTokens::to_token_stream(stmt)))
}

/// Whether `stmts` might move or rebind `loss`: any use that is not `&loss` or `loss.method()`
/// counts (a macro's `loss` argument too: macros may take it by value).
fn moves_or_rebinds(stmts: &[Stmt], loss: &proc_macro2::Ident) -> bool {
    fn check(tokens: proc_macro2::TokenStream, loss: &proc_macro2::Ident) -> bool {
        let trees: Vec<TokenTree> = tokens.into_iter().collect();
        trees.iter().enumerate().any(|(i, tree)| match tree {
            TokenTree::Ident(ident) if ident == loss => {
                let borrowed =
                    i > 0 && matches!(&trees[i - 1], TokenTree::Punct(p) if p.as_char() == '&');
                let method =
                    matches!(trees.get(i + 1), Some(TokenTree::Punct(p)) if p.as_char() == '.');
                !(borrowed || method)
            }
            TokenTree::Group(group) => check(group.stream(), loss),
            TokenTree::Literal(literal) => literal.to_string().contains(&format!("{{{loss}")),
            _ => false,
        })
    }
    stmts
        .iter()
        .any(|stmt| check(quote::ToTokens::to_token_stream(stmt), loss))
}
