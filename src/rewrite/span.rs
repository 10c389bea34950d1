//! The forward pass up to the loss: the statements that mixed precision wraps and that
//! micro-batching repeats, from the first forward call to the `let loss = …;` the step uses.

use proc_macro2::Ident;
use quote::ToTokens;
use syn::spanned::Spanned;
use syn::visit::{self, Visit};
use syn::{Block, Expr, Stmt};

use super::cell::line_of;
use super::step::{loss_binding, Form, Loss, Step};
use super::syntax::{let_bindings, Binding};
use super::Refusal;

/// Method calls that run a model (`seq`/`seq_init`: tch's recurrent nets over a sequence;
/// `forward_all`/`forward_all_t`: a sequential model's every layer's output).
pub(crate) const FORWARD_METHODS: [&str; 8] = [
    "forward",
    "forward_t",
    "apply",
    "apply_t",
    "seq",
    "seq_init",
    "forward_all",
    "forward_all_t",
];

/// The statements from the forward call to the loss binding, in the step's block.
pub(crate) struct ForwardSpan {
    /// Index of the first statement.
    pub start: usize,
    /// Index of the `let loss = …;` statement (the last one of the span).
    pub end: usize,
    /// The variables the span binds (at its top level), in order of first binding; mutability
    /// as the last binding has it.
    pub bound: Vec<Binding>,
    /// The loss variable's binding.
    pub loss: Binding,
    /// Lines of the first and last statements.
    pub lines: (usize, usize),
}

impl ForwardSpan {
    /// Finds the span before `step` in `block` (the step's block).
    pub fn find(block: &Block, step: &Step, flag: &str) -> Result<ForwardSpan, Refusal> {
        let Loss::Var(loss) = &step.loss else {
            return Err(Refusal::at(
                step.line,
                format!("{flag} needs the loss in a variable (`let loss = …;`)"),
            ));
        };
        let stmts = &block.stmts;
        let limit = match step.form {
            Form::Split { backward, .. } => backward,
            _ => step.index,
        };
        let end = loss_binding(stmts, limit, loss).ok_or_else(|| {
            Refusal::at(
                step.line,
                format!(
                    "{flag} looks for the loss binding `let {loss} = …;` before the training \
                     step, in the same block; `{loss}` is bound elsewhere. Compute the loss \
                     right before the step."
                ),
            )
        })?;
        let start = (0..=end).find(|&i| runs_model(&stmts[i])).unwrap_or(end);
        let mut bound: Vec<Binding> = Vec::new();
        for stmt in &stmts[start..=end] {
            for binding in let_bindings(stmt) {
                match bound.iter_mut().find(|b| b.ident == binding.ident) {
                    Some(existing) => *existing = binding,
                    None => bound.push(binding),
                }
            }
        }
        let loss = bound
            .iter()
            .find(|b| b.ident == *loss)
            .cloned()
            .ok_or_else(|| Refusal::at(step.line, format!("{flag}: `{loss}` is not bound")))?;
        Ok(ForwardSpan {
            start,
            end,
            bound,
            loss,
            lines: (line_of(stmts[start].span()), line_of(stmts[end].span())),
        })
    }

    /// The lines, as "line N" or "lines N–M".
    pub fn describe_lines(&self) -> String {
        super::describe_lines(self.lines)
    }
}

/// Whether a statement runs a model (`m.forward(…)`, `xs.apply(&m)`, …) outside closures and
/// nested items (a model's definition has `apply` calls in its closures; it does not run then).
pub(crate) fn runs_model(stmt: &Stmt) -> bool {
    if matches!(stmt, Stmt::Item(_)) {
        return false;
    }
    struct Finder(bool);
    impl<'a> Visit<'a> for Finder {
        fn visit_expr_method_call(&mut self, call: &'a syn::ExprMethodCall) {
            if FORWARD_METHODS.iter().any(|m| call.method == m) {
                self.0 = true;
            }
            visit::visit_expr_method_call(self, call);
        }
        fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
        fn visit_item(&mut self, _: &'a syn::Item) {}
        fn visit_expr_call(&mut self, call: &'a syn::ExprCall) {
            // `tchmem::fused_loss::split_head(|| model.forward(&x))` runs the model in its closure.
            let splits = matches!(&*call.func, syn::Expr::Path(p)
                if p.path.segments.last().is_some_and(|s| s.ident == "split_head"));
            for arg in call.args.iter().filter(|_| splits) {
                if let syn::Expr::Closure(closure) = arg {
                    self.visit_expr(&closure.body);
                }
            }
            visit::visit_expr_call(self, call);
        }
    }
    let mut finder = Finder(false);
    finder.visit_stmt(stmt);
    finder.0
}

/// Control flow that moving statements into a closure (`in_closure`) or into a loop would
/// change: `?`, `return`, `.await` (closure only) and `break`/`continue` leaving the statements.
/// Returns what it found and its line.
pub(crate) fn escaping_control_flow(stmts: &[Stmt], in_closure: bool) -> Option<(String, usize)> {
    struct Finder {
        in_closure: bool,
        loops: usize,
        labels: Vec<String>,
        found: Option<(String, usize)>,
    }
    impl Finder {
        fn found(&mut self, what: &str, span: proc_macro2::Span) {
            if self.found.is_none() {
                self.found = Some((what.to_string(), line_of(span)));
            }
        }
        fn leaves(&self, label: Option<&syn::Lifetime>) -> bool {
            match label {
                Some(label) => !self.labels.contains(&label.ident.to_string()),
                None => self.loops == 0,
            }
        }
        fn in_loop(&mut self, label: Option<&syn::Label>, f: impl FnOnce(&mut Self)) {
            self.loops += 1;
            if let Some(label) = label {
                self.labels.push(label.name.ident.to_string());
            }
            f(self);
            if label.is_some() {
                self.labels.pop();
            }
            self.loops -= 1;
        }
    }
    impl<'a> Visit<'a> for Finder {
        fn visit_expr_try(&mut self, e: &'a syn::ExprTry) {
            if self.in_closure {
                self.found("`?`", e.question_token.span);
            }
            visit::visit_expr_try(self, e);
        }
        fn visit_expr_return(&mut self, e: &'a syn::ExprReturn) {
            self.found("`return`", e.span());
        }
        fn visit_expr_await(&mut self, e: &'a syn::ExprAwait) {
            if self.in_closure {
                self.found("`.await`", e.span());
            }
        }
        fn visit_expr_break(&mut self, e: &'a syn::ExprBreak) {
            if self.leaves(e.label.as_ref()) {
                self.found("`break`", e.span());
            }
            visit::visit_expr_break(self, e);
        }
        fn visit_expr_continue(&mut self, e: &'a syn::ExprContinue) {
            if self.leaves(e.label.as_ref()) {
                self.found("`continue`", e.span());
            }
        }
        fn visit_expr_for_loop(&mut self, e: &'a syn::ExprForLoop) {
            self.visit_expr(&e.expr);
            self.in_loop(e.label.as_ref(), |this| this.visit_block(&e.body));
        }
        fn visit_expr_while(&mut self, e: &'a syn::ExprWhile) {
            self.in_loop(e.label.as_ref(), |this| {
                this.visit_expr(&e.cond);
                this.visit_block(&e.body)
            });
        }
        fn visit_expr_loop(&mut self, e: &'a syn::ExprLoop) {
            self.in_loop(e.label.as_ref(), |this| this.visit_block(&e.body));
        }
        fn visit_expr_block(&mut self, e: &'a syn::ExprBlock) {
            // A labelled block is a `break` target, not a `continue` one; counting it as a
            // loop only lets `continue 'label` through, which does not compile anyway.
            match &e.label {
                Some(label) => {
                    self.labels.push(label.name.ident.to_string());
                    self.visit_block(&e.block);
                    self.labels.pop();
                }
                None => self.visit_block(&e.block),
            }
        }
        fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
        fn visit_item(&mut self, _: &'a syn::Item) {}
        fn visit_expr(&mut self, e: &'a Expr) {
            if self.found.is_none() {
                visit::visit_expr(self, e);
            }
        }
    }
    let mut finder = Finder {
        in_closure,
        loops: 0,
        labels: Vec::new(),
        found: None,
    };
    for stmt in stmts {
        finder.visit_stmt(stmt);
    }
    finder.found
}

/// Whether `tokens` hold the path `a :: b`.
pub(crate) fn has_path(stmts: &[Stmt], a: &str, b: &str) -> bool {
    let needle = format!("{a} :: {b}");
    stmts
        .iter()
        .any(|s| s.to_token_stream().to_string().contains(&needle))
}

/// The variables of `bound` that `later` statements use (besides `loss`), with the line of the
/// first use.
pub(crate) fn used_later(bound: &[Binding], later: &[Stmt], loss: &Ident) -> Vec<(Ident, usize)> {
    bound
        .iter()
        .filter(|b| b.ident != *loss)
        .filter_map(|b| {
            let name = b.ident.to_string();
            later
                .iter()
                .find(|s| super::syntax::mentions(s.to_token_stream(), &name))
                .map(|s| (b.ident.clone(), line_of(s.span())))
        })
        .collect()
}
