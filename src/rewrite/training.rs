//! Mixed precision and micro-batching: both rewrite the training step's block, from the forward
//! call to the optimizer step, so they are planned and applied together.

use proc_macro2::Ident;
use quote::quote;
use syn::{Block, Stmt};

use super::accumulate::{self, Generated, MicroPlan};
use super::amp;
use super::change::Change;
use super::earlier::EarlierFn;
use super::optimizer::{builds, Build};
use super::span::{escaping_control_flow, has_path, used_later, ForwardSpan};
use super::step::{self, Clip, Form, Loss, Step};
use super::syntax::{stmts, stmts_mention, Binding, Names};
use super::tree::{edit_block, Tree};
use super::{Amp, Refusal};

/// What to do to the training step, and what the rewriter may read for it.
pub(crate) struct Plan<'a> {
    /// Mixed precision.
    pub amp: Option<Amp>,
    /// Micro-batches per batch.
    pub accumulate: Option<u32>,
    /// The functions of earlier cells the cell calls.
    pub functions: &'a [EarlierFn],
}

/// Applies `--amp` and/or `--accumulate` to the cell's training step.
pub(crate) fn apply(
    block: &mut Block,
    plan: &Plan,
    names: &mut Names,
    changes: &mut Vec<Change>,
) -> Result<(), Refusal> {
    let (amp, accumulate) = (plan.amp, plan.accumulate);
    let flag = match (amp, accumulate) {
        (Some(_), Some(_)) => "--amp with --accumulate",
        (Some(_), None) => "--amp",
        _ => "--accumulate",
    };
    let step = find_step(block, flag)?;
    if let Loss::Inline(expr) = &step.loss {
        hoist_loss(block, &step, (**expr).clone(), names, changes)?;
    }
    let step = find_step(block, flag)?;
    let f16 = amp == Some(Amp::F16);

    check_form(block, &step, f16, accumulate.is_some(), flag)?;

    // f16: the grad scaler, created right after the optimizer.
    let scaler = if f16 {
        let scaler = names.fresh("grad_scaler");
        add_scaler(block, &step, &scaler, changes)?;
        Some(scaler)
    } else {
        None
    };
    let step = find_step(block, flag)?;

    let tree = Tree::of(block);
    let info = &tree.blocks[step.block];
    let span = ForwardSpan::find(info.block, &step, flag)?;
    let stmts_now = &info.block.stmts;
    let span_stmts = &stmts_now[span.start..=span.end];
    check_span(&span, span_stmts, amp.is_some(), flag)?;
    if amp.is_some() {
        check_autocast_ops(&span, span_stmts, plan.functions, flag)?;
    }
    let later = &stmts_now[span.end + 1..];
    let micro = match accumulate {
        Some(k) => Some(plan_micro_batches(k, &tree, &step, &span, later, names)?),
        None => None,
    };

    let restructure = f16 || accumulate.is_some();
    let (backward, zero_grad) = match step.form {
        Form::Split {
            backward,
            zero_grad,
        } => (Some(backward), zero_grad),
        _ => (None, None),
    };

    // The span, under autocast if asked; returning what later statements use. A `zero_grad`
    // inside it is the scaler's or the micro-batch loop's job now.
    let mut body: Vec<Stmt> = (span.start..=span.end)
        .filter(|&i| !(restructure && Some(i) == zero_grad))
        .map(|i| stmts_now[i].clone())
        .collect();
    if let Some(amp) = amp {
        let returned: Vec<Binding> = if micro.is_some() {
            vec![span.loss.clone()]
        } else {
            span.bound
                .iter()
                .filter(|b| {
                    b.ident == span.loss.ident || stmts_mention(later, &b.ident.to_string())
                })
                .cloned()
                .collect()
        };
        // On the model's device (from the VarStore its optimizer is built from) when the cell
        // says; else CUDA when there is one.
        let device = optimizer_site(&tree, &step).map(|site| site.vs);
        body = vec![amp::autocast(amp, device.as_ref(), &body, &returned)?];
        changes.push(amp_change(span.lines, f16));
    }
    let mut replacement = body;
    if let Some(plan) = &micro {
        let generated = Generated::new(names);
        replacement = accumulate::micro_batches(
            plan,
            &replacement,
            &span,
            &step.opt,
            scaler.as_ref(),
            &generated,
        )?;
        let batch_norm = quote::ToTokens::to_token_stream(&*block)
            .to_string()
            .contains("batch_norm");
        changes.extend(accumulate_changes(plan, &span, batch_norm));
    }

    let step_replacement = step_stmts(&step, accumulate.is_some(), scaler.as_ref())?;
    if let Some(scaler) = &scaler {
        changes.push(scaler_change(scaler, &step, &span, accumulate.is_some()));
    }

    let new_stmts = assemble(
        stmts_now,
        &span,
        &step,
        &replacement,
        step_replacement.as_deref(),
        restructure.then_some((backward, zero_grad)),
    );
    let target: *const Block = info.block;
    drop(tree);
    edit_block(block, target, |b| b.stmts = new_stmts);
    Ok(())
}

/// What `--amp` did to the forward span, for the list of changes.
fn amp_change(lines: (usize, usize), f16: bool) -> Change {
    let (name, kind) = if f16 {
        ("f16", "Half")
    } else {
        ("bf16", "BFloat16")
    };
    Change::over(
        lines,
        format!(
            "--amp {name}: the forward pass and loss run under tchmem::amp::autocast({kind}): \
             matmuls and convolutions compute in {name}, so their activations take half the \
             memory; parameters, gradients and optimizer state stay f32"
        ),
    )
}

/// What `--accumulate K` did, for the list of changes (and what it changes for batch norm).
fn accumulate_changes(plan: &MicroPlan, span: &ForwardSpan, batch_norm: bool) -> Vec<Change> {
    let MicroPlan { k, batch, sizes } = plan;
    let batch_names: Vec<String> = batch.iter().map(|b| b.describe()).collect();
    let mut changes = vec![Change::over(
        span.lines,
        format!(
            "--accumulate {k}: the batch ({}) runs as {k} micro-batches \
             (tchmem::accumulate::split, along dim 0); each micro-batch's loss is weighted by \
             its share of the batch, so the gradients add up to the whole batch's, and the \
             optimizer steps once per batch; `{}` is the whole batch's loss, as before",
            batch_names.join(", "),
            span.loss.ident,
        ),
    )];
    for size in sizes {
        changes.push(Change::over(
            span.lines,
            format!(
                "--accumulate {k}: in the forward pass and loss, `{size}` reads the micro-batch's \
                 size (tchmem::accumulate::micro_size, in `{size}`'s type), so shapes spelled \
                 with it fit the micro-batch"
            ),
        ));
    }
    if batch_norm {
        changes.push(Change::general(
            "note: batch-norm layers normalise over each micro-batch, not the whole batch, so \
             their statistics (and outputs) change",
        ));
    }
    changes
}

/// What the f16 grad scaler does in place of the step, for the list of changes.
fn scaler_change(scaler: &Ident, step: &Step, span: &ForwardSpan, accumulating: bool) -> Change {
    let text = if accumulating {
        format!(
            "--amp f16: {scaler}.step(&mut {}) replaces the step: it unscales the accumulated \
             gradients and skips the step when they overflow",
            step.opt
        )
    } else {
        format!(
            "--amp f16: {scaler}.backward_step(&mut {}, &{}) replaces the step: it scales the \
             loss so that f16 gradients do not underflow, unscales them, and skips the step \
             when they overflow",
            step.opt, span.loss.ident
        )
    };
    Change::at(step.line, text)
}

/// Refuses a step whose form the rewrite cannot keep, before anything changes: f16 with
/// clipping inside `backward_step_clip*`, statements between `backward()` and `step()` that
/// would see scaled gradients, no `zero_grad()` beside the step.
fn check_form(
    block: &Block,
    step: &Step,
    f16: bool,
    accumulate: bool,
    flag: &str,
) -> Result<(), Refusal> {
    match (&step.form, f16) {
        (Form::Combined { clip: Some(_) }, true) => {
            return Err(Refusal::at(
                step.line,
                "--amp f16 rewrites `backward_step(&loss)` into a GradScaler step, which does \
                 not clip gradients; with backward_step_clip/backward_step_clip_norm use \
                 --amp bf16 (no scaler needed)",
            ));
        }
        (Form::Split { backward, .. }, true) => {
            let tree = Tree::of(block);
            let stmts = &tree.blocks[step.block].block.stmts;
            if let Some(other) =
                (backward + 1..step.index).find(|&i| !is_zero_grad(&stmts[i], step))
            {
                return Err(Refusal::at(
                    super::cell::line_of(syn::spanned::Spanned::span(&stmts[other])),
                    format!(
                        "--amp f16 replaces `loss.backward()` … `{}.step()` with one GradScaler \
                         step, and this statement between them would see scaled gradients \
                         (gradient clipping needs unscaled ones); use --amp bf16, which needs \
                         no scaler",
                        step.opt
                    ),
                ));
            }
        }
        _ => {}
    }
    if let Form::Split {
        zero_grad: None, ..
    } = step.form
    {
        if f16 || accumulate {
            return Err(Refusal::at(
                step.line,
                format!(
                    "{flag} looks for `{0}.zero_grad()` in the same block as `{0}.step()`; \
                     found none, so gradients add up across steps, which this rewrite cannot \
                     keep. Add `{0}.zero_grad();` before the backward pass.",
                    step.opt
                ),
            ));
        }
    }
    Ok(())
}

/// Refuses `--amp` where autocast would make libtorch refuse an op of the forward pass and loss.
fn check_autocast_ops(
    span: &ForwardSpan,
    span_stmts: &[Stmt],
    functions: &[EarlierFn],
    flag: &str,
) -> Result<(), Refusal> {
    let Some((op, function)) = amp::refused_op(span_stmts, functions) else {
        return Ok(());
    };
    let place = match function {
        Some(f) => format!(" (in `{}`, a function of cell [{}])", f.name, f.run),
        None => String::new(),
    };
    Err(Refusal::naming(
        span.lines.0,
        span.lines,
        format!(
            "{flag} would run the forward pass and loss ({}) under autocast, and they call \
             {op}{place}; libtorch refuses it under autocast (its reduced-precision result is \
             unsafe). Compute the loss from the logits with {op}_with_logits (leaving out \
             the sigmoid before it), which autocast runs in f32.",
            span.describe_lines()
        ),
    ))
}

/// Refuses a forward span that cannot move into a closure or a loop: control flow that would
/// leave it (`return`, `break`, `?`), or, under autocast, a binding by reference.
fn check_span(
    span: &ForwardSpan,
    span_stmts: &[Stmt],
    amp: bool,
    flag: &str,
) -> Result<(), Refusal> {
    if let Some((what, line)) = escaping_control_flow(span_stmts, amp) {
        let into = if amp {
            "a closure (tchmem::amp::autocast)"
        } else {
            "a loop over micro-batches"
        };
        return Err(Refusal::naming(
            line,
            span.lines,
            format!(
                "{flag} moves the forward pass and loss ({}) into {into}, and {what} there \
                 would then leave it instead of the original code; move it out of those lines",
                span.describe_lines()
            ),
        ));
    }
    if amp {
        if let Some(by_ref) = span.bound.iter().find(|b| b.by_ref) {
            return Err(Refusal::naming(
                span.lines.0,
                span.lines,
                format!(
                    "--amp: `ref {}` in the forward pass and loss ({}) would borrow from inside \
                     the autocast closure; bind it by value",
                    by_ref.ident,
                    span.describe_lines()
                ),
            ));
        }
    }
    Ok(())
}

/// The block's new statements: the span replaced by `replacement`, the step by
/// `step_replacement` (when there is one), and, when the step is restructured (`removed`), its
/// `backward()` and `zero_grad()` dropped (the scaler's or the micro-batch loop's job now).
fn assemble(
    stmts: &[Stmt],
    span: &ForwardSpan,
    step: &Step,
    replacement: &[Stmt],
    step_replacement: Option<&[Stmt]>,
    removed: Option<(Option<usize>, Option<usize>)>,
) -> Vec<Stmt> {
    let mut new_stmts = Vec::with_capacity(stmts.len() + 4);
    for (i, stmt) in stmts.iter().enumerate() {
        let dropped = removed
            .is_some_and(|(backward, zero_grad)| Some(i) == backward || Some(i) == zero_grad);
        if i == span.start {
            new_stmts.extend(replacement.iter().cloned());
        } else if (span.start..=span.end).contains(&i) || dropped {
            // Replaced above, or the scaler's or the micro-batch loop's job now.
        } else if i == step.index {
            match step_replacement {
                Some(replacement) => new_stmts.extend(replacement.iter().cloned()),
                None => new_stmts.push(stmt.clone()),
            }
        } else {
            new_stmts.push(stmt.clone());
        }
    }
    new_stmts
}

fn find_step(block: &Block, flag: &str) -> Result<Step, Refusal> {
    let tree = Tree::of(block);
    let step = step::the_step(&tree, flag)?;
    if let Form::Rewritten = step.form {
        return Err(Refusal::at(
            step.line,
            format!(
                "{flag}: the training step was already rewritten by tchmem; rewrite the \
                 original cell, with all the flags you want at once"
            ),
        ));
    }
    Ok(step)
}

fn is_zero_grad(stmt: &Stmt, step: &Step) -> bool {
    step::method_call(stmt).is_some_and(|call| {
        call.method == "zero_grad" && super::syntax::as_ident(&call.receiver) == Some(&step.opt)
    })
}

/// `opt.backward_step(&<expr>)` → `let loss = <expr>; opt.backward_step(&loss);`, so that the
/// loss's computation is a statement the rewrites can wrap.
pub(crate) fn hoist_loss(
    block: &mut Block,
    step: &Step,
    expr: syn::Expr,
    names: &mut Names,
    changes: &mut Vec<Change>,
) -> Result<(), Refusal> {
    let loss = names.fresh("loss");
    let binding = stmts(quote!(let #loss = #expr;))?;
    let tree = Tree::of(block);
    let target: *const Block = tree.blocks[step.block].block;
    drop(tree);
    let index = step.index;
    edit_block(block, target, |b| {
        if let Some(Stmt::Expr(syn::Expr::MethodCall(call), _)) = b.stmts.get_mut(index) {
            if let Some(arg) = call.args.first_mut() {
                *arg = syn::parse_quote!(&#loss);
            }
        }
        b.stmts.splice(index..index, binding);
    });
    changes.push(Change::at(
        step.line,
        format!(
            "the loss passed to {}.backward_step(…) is bound first (`let {loss} = …;`), so \
             that the rewrites can wrap its computation",
            step.opt
        ),
    ));
    Ok(())
}

/// Where the optimizer the step uses is built in this cell (in scope at the step), if it is.
fn optimizer_site(tree: &Tree, step: &Step) -> Option<Build> {
    builds(tree).into_iter().rev().find(|b| {
        b.binding.as_ref() == Some(&step.opt)
            && tree.sees(step.block, b.block)
            && (b.block != step.block || b.index < step.index)
    })
}

/// Inserts `let mut grad_scaler = tchmem::amp::GradScaler::new(&vs);` after the optimizer the
/// step uses is built.
fn add_scaler(
    block: &mut Block,
    step: &Step,
    scaler: &Ident,
    changes: &mut Vec<Change>,
) -> Result<(), Refusal> {
    let tree = Tree::of(block);
    let Some(site) = optimizer_site(&tree, step) else {
        return Err(Refusal::at(
            step.line,
            format!(
                "--amp f16 looks for the optimizer `{0}` built in this cell (`let mut {0} = \
                 nn::Adam::default().build(&vs, lr)?;` or similar, in scope at the training \
                 step) to create the GradScaler next to it; found none. Build the optimizer in \
                 this cell, or use --amp bf16, which needs no scaler.",
                step.opt
            ),
        ));
    };
    let created = amp::scaler(scaler, &site.vs)?;
    let target: *const Block = tree.blocks[site.block].block;
    let at = site.index + 1;
    drop(tree);
    edit_block(block, target, |b| {
        b.stmts.splice(at..at, created);
    });
    changes.push(Change::at(
        site.line,
        format!(
            "--amp f16: a tchmem::amp::GradScaler (`{scaler}`) is created after the optimizer \
             `{}`",
            step.opt
        ),
    ));
    Ok(())
}

/// The split into `k` micro-batches (the batch tensors, the names of the batch size), after
/// checking that micro-batching keeps the loop's meaning.
fn plan_micro_batches(
    k: u32,
    tree: &Tree,
    step: &Step,
    span: &ForwardSpan,
    later: &[Stmt],
    names: &mut Names,
) -> Result<MicroPlan, Refusal> {
    let stmts = &tree.blocks[step.block].block.stmts[span.start..=span.end];
    if let Some((what, line)) = accumulate::builds_model(stmts) {
        return Err(Refusal::naming(
            line,
            span.lines,
            format!(
                "--accumulate would repeat the forward pass and loss ({}) once per \
                 micro-batch, and they build model parts ({what}); build the model before the \
                 training loop",
                span.describe_lines()
            ),
        ));
    }
    if let Some((variable, line)) = accumulate::outer_assignment(stmts) {
        return Err(Refusal::naming(
            line,
            span.lines,
            format!(
                "--accumulate repeats the forward pass and loss ({}) once per micro-batch, \
                 and this line updates `{variable}`, which they do not bind: it would run once \
                 per micro-batch instead of once per batch. Move it after the training step.",
                span.describe_lines(),
            ),
        ));
    }
    if has_path(stmts, "Reduction", "Sum") {
        return Err(Refusal::at(
            span.lines.1,
            "--accumulate weights each micro-batch's loss by its share of the batch, which is \
             right for a mean loss; this loss uses Reduction::Sum. Use Reduction::Mean, or \
             accumulate by hand.",
        ));
    }
    let used = used_later(&span.bound, later, &span.loss.ident);
    if let Some((name, line)) = used.first() {
        return Err(Refusal::naming(
            *line,
            span.lines,
            format!(
                "--accumulate: `{name}` is bound by the forward pass and loss ({}) and used \
                 after the loss; with micro-batches it would hold only the last micro-batch's \
                 value. Compute it from the whole batch after the step (or drop that use).",
                span.describe_lines()
            ),
        ));
    }
    let batch = accumulate::batch_tensors(tree, step.block, span, names)?;
    let sizes = accumulate::batch_size_names(stmts, &batch);
    Ok(MicroPlan { k, batch, sizes })
}

/// What replaces the step statement when the step is restructured (`None`: keep it).
fn step_stmts(
    step: &Step,
    accumulating: bool,
    scaler: Option<&Ident>,
) -> Result<Option<Vec<Stmt>>, Refusal> {
    let opt = &step.opt;
    let tokens = match (accumulating, scaler) {
        (false, None) => return Ok(None),
        (false, Some(scaler)) => {
            let Loss::Var(loss) = &step.loss else {
                return Ok(None);
            };
            quote!(#scaler.backward_step(&mut #opt, &#loss);)
        }
        (true, Some(scaler)) => quote!(#scaler.step(&mut #opt);),
        (true, None) => match &step.form {
            Form::Combined {
                clip: Some(Clip::Value(max)),
            } => quote!(#opt.clip_grad_value(#max); #opt.step();),
            Form::Combined {
                clip: Some(Clip::Norm(max)),
            } => quote!(#opt.clip_grad_norm(#max); #opt.step();),
            _ => quote!(#opt.step();),
        },
    };
    stmts(tokens).map(Some)
}
