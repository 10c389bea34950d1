//! Gradient accumulation by micro-batching: the forward pass, loss and backward pass run once per
//! micro-batch of the batch tensors (split along dim 0 by `tchmem::accumulate::split`), each
//! loss weighted by its micro-batch's share of the batch, so that the gradients add up to the
//! whole batch's; the optimizer steps once.

use proc_macro2::Ident;
use quote::{quote, ToTokens};
use syn::visit::{self, Visit};
use syn::visit_mut::{self, VisitMut};
use syn::{Expr, Stmt};

use super::cell::line_of;
use super::span::{ForwardSpan, FORWARD_METHODS};
use super::syntax::{as_ident, bindings, let_bindings, mentions, stmts, strip_parens, Names};
use super::tree::{Loop, Role, Tree};
use super::Refusal;

/// The names of the variables the generated code declares.
pub(crate) struct Generated {
    pub weight: Ident,
    pub accumulated: Ident,
    pub scaled: Ident,
    pub part: Ident,
    pub sum: Ident,
    /// The micro-batch's size, where the forward pass uses the batch size.
    pub micro_size: Ident,
}

impl Generated {
    pub fn new(names: &mut Names) -> Generated {
        Generated {
            weight: names.fresh("weight"),
            accumulated: names.fresh("accumulated"),
            scaled: names.fresh("scaled"),
            part: names.fresh("part"),
            sum: names.fresh("sum"),
            micro_size: names.fresh("micro_batch_size"),
        }
    }
}

/// Methods whose result is a number or a property, not a batch tensor.
const SCALAR_METHODS: [&str; 14] = [
    "size",
    "size1",
    "size2",
    "size3",
    "size4",
    "dim",
    "numel",
    "kind",
    "device",
    "int64_value",
    "double_value",
    "len",
    "is_empty",
    "defined",
];

/// A tensor the micro-batches split along dim 0.
pub(crate) struct BatchTensor {
    /// What the step reads: a variable (`xs`), or a data set's tensor it reads through a field
    /// (`m.train_images`: a full-batch loop).
    pub whole: Expr,
    /// The name a micro-batch of it is bound to: the variable itself, or a fresh name for a
    /// field, which the forward pass and loss then read instead.
    pub part: Ident,
}

impl BatchTensor {
    fn variable(ident: Ident) -> BatchTensor {
        BatchTensor {
            whole: syn::parse_quote!(#ident),
            part: ident,
        }
    }

    /// How the list of changes names it: `xs`, `m.train_images`.
    pub fn describe(&self) -> String {
        compact(&self.whole)
    }
}

/// The batch tensors the forward pass uses: bound by the innermost training loop's pattern
/// (not the `enumerate()` index), by the enclosing function's `Tensor` parameters, or by `let`
/// statements between the start of the step's block and the forward call; last binding wins.
/// Without any, the tensors the step reads through fields ([`field_tensors`]): a loop that
/// trains on a whole data set every step.
pub(crate) fn batch_tensors(
    tree: &Tree,
    block_id: usize,
    span: &ForwardSpan,
    names: &mut Names,
) -> Result<Vec<BatchTensor>, Refusal> {
    let block = tree.blocks[block_id].block;
    let mut candidates: Vec<Ident> = Vec::new();
    // The last binding of a name decides whether it is a batch tensor; the first, where it
    // goes in the list.
    fn add(candidates: &mut Vec<Ident>, ident: &Ident, tensor: bool) {
        match candidates.iter().position(|c| c == ident) {
            Some(i) if !tensor => {
                candidates.remove(i);
            }
            None if tensor => candidates.push(ident.clone()),
            _ => {}
        }
    }
    if let Some(&loop_body) = tree.loops(block_id).first() {
        if let Role::Loop(Loop::For(for_loop)) = tree.blocks[loop_body].role {
            for binding in loop_bindings(for_loop) {
                add(&mut candidates, &binding, true);
            }
        }
    }
    for id in tree.ancestors(block_id) {
        if tree.blocks[id].item_scope != tree.blocks[block_id].item_scope {
            break;
        }
        if let Role::Fn(sig) = tree.blocks[id].role {
            for input in &sig.inputs {
                if let syn::FnArg::Typed(arg) = input {
                    let tensor = is_tensor_type(&arg.ty);
                    for binding in bindings(&arg.pat) {
                        add(&mut candidates, &binding.ident, tensor);
                    }
                }
            }
            break;
        }
    }
    // With a loop pattern or tensor parameters, a `let` is a batch tensor only if it derives
    // from one (`let xs = xs.to_device(d)`), not a constant like a mask; without them (a
    // `while` loop slicing a data set), any tensor value is.
    let span_stmts = &block.stmts[span.start..=span.end];
    let used_in_span = |c: &Ident| {
        let name = c.to_string();
        span_stmts
            .iter()
            .any(|s| mentions(s.to_token_stream(), &name))
    };
    let derived_only = candidates.iter().any(used_in_span);
    for stmt in &block.stmts[..span.start] {
        if let Stmt::Local(local) = stmt {
            let tensor = local.init.as_ref().is_some_and(|init| {
                let derived = candidates
                    .iter()
                    .any(|c| mentions(init.expr.to_token_stream(), &c.to_string()));
                !is_scalar(&init.expr) && (derived || !derived_only)
            });
            for binding in let_bindings(stmt) {
                add(&mut candidates, &binding.ident, tensor);
            }
        }
    }
    let mut through_fields = Vec::new();
    let batch: Vec<Ident> = candidates
        .into_iter()
        .filter(used_in_span)
        .filter(|c| {
            let field = used_through_field(span_stmts, c);
            if field {
                through_fields.push(c.to_string());
            }
            !field
        })
        .collect();
    if !batch.is_empty() {
        return Ok(batch.into_iter().map(BatchTensor::variable).collect());
    }
    let fields = field_tensors(span_stmts, names);
    if !fields.is_empty() {
        return Ok(fields);
    }
    let hint = match through_fields.as_slice() {
        [] => String::new(),
        names => format!(
            " ({} is used through a field, but no field goes into the forward call as it is)",
            names.join(", ")
        ),
    };
    Err(Refusal::naming(
        span.lines.0,
        span.lines,
        format!(
            "--accumulate looks for the batch tensors that the forward pass uses: variables \
             bound by the training loop's pattern (`for (xs, ys) in …`) or by `let` statements \
             before the forward call, or a data set's tensors that the forward call takes \
             through a field (`net.forward(&m.train_images)`); the forward pass and loss ({}) \
             use none{hint}. Bind the batch with `let xs = …;` before the forward call.",
            span.describe_lines()
        ),
    ))
}

/// Methods that keep a tensor's rows as they are: a field read through them is still the whole
/// data set (`m.train_images.to_device(d)`); one read through any other (`narrow`, `i`) is a
/// selection the loop makes, not a batch to split.
const ROW_KEEPING_METHODS: [&str; 9] = [
    "to_device",
    "to",
    "to_kind",
    "shallow_clone",
    "view",
    "reshape",
    "contiguous",
    "detach",
    "flatten",
];

/// The variable at the root of a chain of fields (`m` of `m.data.images`), if `expr` is one.
fn field_root(expr: &Expr) -> Option<&Ident> {
    let Expr::Field(field) = strip_parens(expr) else {
        return None;
    };
    let mut base = &*field.base;
    while let Expr::Field(inner) = strip_parens(base) {
        base = &inner.base;
    }
    as_ident(base)
}

/// The field an argument reads whole: `m.train_images` of `&m.train_images` or of
/// `&m.train_images.to_device(d)` (through [`ROW_KEEPING_METHODS`] only).
fn read_field(expr: &Expr) -> Option<&Expr> {
    match strip_parens(expr) {
        Expr::Reference(r) => read_field(&r.expr),
        Expr::MethodCall(call)
            if ROW_KEEPING_METHODS.contains(&call.method.to_string().as_str()) =>
        {
            read_field(&call.receiver)
        }
        field @ Expr::Field(_) => field_root(field).map(|_| field),
        _ => None,
    }
}

/// The tensors a step reads through fields (`m.train_images`, `batch.0`): what the forward call
/// takes (`net.forward(&m.train_images)`, `m.train_images.to_device(d).apply(&net)`), then the
/// fields of the same variables that the forward pass and loss pass to a method
/// (`.cross_entropy_for_logits(&m.train_labels)`), in order of first use, each with a fresh name
/// for its micro-batch (`micro_train_images`). A model's own fields (`t.net` of
/// `t.net.forward(&t.xs)`), what goes inside `Some(…)`, and a field a macro in the span reads
/// (which the rename cannot reach) make none.
fn field_tensors(span_stmts: &[Stmt], names: &mut Names) -> Vec<BatchTensor> {
    /// The fields a forward call takes: its argument, or `apply`'s receiver.
    struct Inputs<'a>(Vec<&'a Expr>);
    impl<'a> Visit<'a> for Inputs<'a> {
        fn visit_expr_method_call(&mut self, call: &'a syn::ExprMethodCall) {
            let method = call.method.to_string();
            if FORWARD_METHODS.contains(&method.as_str()) {
                let input = if method.starts_with("apply") {
                    Some(&*call.receiver)
                } else {
                    call.args.first()
                };
                if let Some(field) = input.and_then(read_field) {
                    self.0.push(field);
                }
            }
            visit::visit_expr_method_call(self, call);
        }
    }
    /// Fields that methods take as arguments (`&m.train_labels`), in order: tensors, where a
    /// plain `m.labels` may be a number.
    struct Arguments<'a>(Vec<&'a Expr>);
    impl<'a> Visit<'a> for Arguments<'a> {
        fn visit_expr_method_call(&mut self, call: &'a syn::ExprMethodCall) {
            self.0.extend(call.args.iter().filter_map(read_field));
            visit::visit_expr_method_call(self, call);
        }
    }
    /// Whether a macro's tokens name `root`.
    struct InMacro<'r>(&'r Ident, bool);
    impl<'a> Visit<'a> for InMacro<'_> {
        fn visit_macro(&mut self, mac: &'a syn::Macro) {
            self.1 |= mentions(mac.tokens.clone(), &self.0.to_string());
        }
    }
    let mut inputs = Inputs(Vec::new());
    let mut arguments = Arguments(Vec::new());
    for stmt in span_stmts {
        inputs.visit_stmt(stmt);
        arguments.visit_stmt(stmt);
    }
    let roots: Vec<&Ident> = inputs.0.iter().filter_map(|e| field_root(e)).collect();
    for root in &roots {
        let mut in_macro = InMacro(root, false);
        span_stmts.iter().for_each(|s| in_macro.visit_stmt(s));
        if in_macro.1 {
            return Vec::new();
        }
    }
    let mut found: Vec<BatchTensor> = Vec::new();
    let same_root = arguments
        .0
        .into_iter()
        .filter(|e| field_root(e).is_some_and(|root| roots.contains(&root)));
    for expr in inputs.0.into_iter().chain(same_root) {
        let text = compact(expr);
        if found.iter().any(|t| t.describe() == text) {
            continue;
        }
        // `micro_train_images`: the field's name says which tensor, the prefix that it is a
        // micro-batch of it (a plain `train_images` is taken by the field itself).
        let base = match expr {
            Expr::Field(field) => match &field.member {
                syn::Member::Named(name) => format!("micro_{name}"),
                syn::Member::Unnamed(index) => format!("micro_{}", index.index),
            },
            _ => "micro_batch".to_string(),
        };
        found.push(BatchTensor {
            whole: expr.clone(),
            part: names.fresh(&base),
        });
    }
    found
}

/// A variable or a chain of fields as written, without the token printer's spaces.
fn compact(expr: &Expr) -> String {
    expr.to_token_stream().to_string().replace(' ', "")
}

/// The variables a `for` pattern binds, without the index of `.enumerate()` (or any, for a
/// loop over a range of numbers).
fn loop_bindings(for_loop: &syn::ExprForLoop) -> Vec<Ident> {
    if let Expr::Range(_) = super::syntax::strip_parens(&for_loop.expr) {
        return Vec::new();
    }
    let enumerated = matches!(
        super::syntax::strip_parens(&for_loop.expr),
        Expr::MethodCall(call) if call.method == "enumerate"
    );
    match (&*for_loop.pat, enumerated) {
        (syn::Pat::Tuple(tuple), true) if tuple.elems.len() == 2 => bindings(&tuple.elems[1]),
        (pat, _) => bindings(pat),
    }
    .into_iter()
    .map(|b| b.ident)
    .collect()
}

/// `Tensor` or `&Tensor` (any path ending in `Tensor`).
fn is_tensor_type(ty: &syn::Type) -> bool {
    match ty {
        syn::Type::Reference(r) => is_tensor_type(&r.elem),
        syn::Type::Path(p) => p.path.segments.last().is_some_and(|s| s.ident == "Tensor"),
        _ => false,
    }
}

/// Whether a `let` value is a number or property rather than a tensor: a literal, a cast, a
/// `size()`-like call, a conversion (`f64::try_from`), or arithmetic on those.
fn is_scalar(expr: &Expr) -> bool {
    match expr {
        Expr::Lit(_) | Expr::Cast(_) | Expr::Range(_) => true,
        Expr::Paren(e) => is_scalar(&e.expr),
        Expr::Reference(e) => is_scalar(&e.expr),
        Expr::Try(e) => is_scalar(&e.expr),
        Expr::Index(e) => is_scalar(&e.expr),
        Expr::Unary(e) => is_scalar(&e.expr),
        Expr::Binary(e) => is_scalar(&e.left) && is_scalar(&e.right),
        Expr::MethodCall(call) => {
            let method = call.method.to_string();
            match method.as_str() {
                "unwrap" | "expect" | "clone" => is_scalar(&call.receiver),
                _ => SCALAR_METHODS.contains(&method.as_str()),
            }
        }
        Expr::Call(call) => match &*call.func {
            Expr::Path(p) => p
                .path
                .segments
                .last()
                .is_some_and(|s| s.ident == "try_from" || s.ident == "from"),
            _ => false,
        },
        _ => false,
    }
}

/// Whether `stmts` use `name.field` (a struct, not a tensor).
fn used_through_field(stmts: &[Stmt], name: &Ident) -> bool {
    struct Finder<'n>(&'n Ident, bool);
    impl<'a> Visit<'a> for Finder<'_> {
        fn visit_expr_field(&mut self, e: &'a syn::ExprField) {
            if as_ident(&e.base) == Some(self.0) {
                self.1 = true;
            }
            visit::visit_expr_field(self, e);
        }
    }
    let mut finder = Finder(name, false);
    stmts.iter().for_each(|s| finder.visit_stmt(s));
    finder.1
}

/// Whether the span builds model parts or optimizers (`nn::linear(…)`, `VarStore::new`,
/// `.build(&vs, lr)`), which must not run once per micro-batch. Returns what and its line.
pub(crate) fn builds_model(stmts: &[Stmt]) -> Option<(String, usize)> {
    struct Finder(Option<(String, usize)>);
    impl<'a> Visit<'a> for Finder {
        fn visit_expr_call(&mut self, call: &'a syn::ExprCall) {
            if let Expr::Path(p) = &*call.func {
                let names = super::syntax::segments(&p.path);
                let building = names.iter().any(|n| n == "VarStore")
                    || (names.len() >= 2
                        && names[names.len() - 2] == "nn"
                        && names
                            .last()
                            .is_some_and(|n| n.starts_with(|c: char| c.is_lowercase())));
                if building && self.0.is_none() {
                    self.0 = Some((names.join("::"), line_of(syn::spanned::Spanned::span(call))));
                }
            }
            visit::visit_expr_call(self, call);
        }
        fn visit_expr_method_call(&mut self, call: &'a syn::ExprMethodCall) {
            if call.method == "build" && call.args.len() == 2 && self.0.is_none() {
                self.0 = Some((
                    "an optimizer's .build(…)".to_string(),
                    line_of(call.method.span()),
                ));
            }
            visit::visit_expr_method_call(self, call);
        }
    }
    let mut finder = Finder(None);
    stmts.iter().for_each(|s| finder.visit_stmt(s));
    finder.0
}

/// How a batch is split: into `k` micro-batches of the `batch` tensors, with the names the
/// forward pass and loss use for the batch size (`sizes`, see [`batch_size_names`]).
pub(crate) struct MicroPlan {
    pub k: u32,
    pub batch: Vec<BatchTensor>,
    pub sizes: Vec<Ident>,
}

/// What replaces the span: `opt.zero_grad();` and the micro-batch loop that binds the loss.
/// `body` is the span (already under autocast if mixed precision is on); with a grad scaler,
/// the backward pass is scaled. Each micro-batch's forward and backward pass is marked
/// (`tchmem::phase`; see `phases`).
pub(crate) fn micro_batches(
    plan: &MicroPlan,
    body: &[Stmt],
    span: &ForwardSpan,
    opt: &Ident,
    scaler: Option<&Ident>,
    names: &Generated,
) -> Result<Vec<Stmt>, Refusal> {
    let Generated {
        weight,
        accumulated,
        scaled,
        part,
        sum,
        micro_size,
    } = names;
    let MicroPlan { k, batch, sizes } = plan;
    let mut body = body.to_vec();
    // A data set's tensors read through fields: the micro-batch's name in their place.
    let mut read_parts = ReadParts(batch);
    body.iter_mut().for_each(|s| read_parts.visit_stmt_mut(s));
    // Inside a micro-batch the batch size is the micro-batch's (`view([BATCH_SIZE * T, C])`),
    // in the batch size's own type.
    let size_of_micro = match (sizes.first(), batch.first().map(|t| &t.part)) {
        (Some(whole), Some(first)) => {
            let mut rename = Rename {
                from: sizes,
                to: micro_size,
            };
            body.iter_mut().for_each(|s| rename.visit_stmt_mut(s));
            quote!(let #micro_size = tchmem::accumulate::micro_size(&#first, #whole);)
        }
        _ => quote!(),
    };
    let loss = &span.loss.ident;
    let loss_pattern = if span.loss.mutable {
        quote!(mut #loss)
    } else {
        quote!(#loss)
    };
    let k = proc_macro2::Literal::u32_unsuffixed(*k);
    let parts = batch.iter().map(|t| &t.part);
    let wholes = batch.iter().map(|t| &t.whole);
    let backward = match scaler {
        Some(scaler) => quote!(#scaler.scale(&#scaled).backward();),
        None => quote!(#scaled.backward();),
    };
    stmts(quote! {
        #opt.zero_grad();
        let #loss_pattern = {
            let mut #accumulated: Option<tch::Tensor> = None;
            for (#weight, [#(ref #parts),*]) in tchmem::accumulate::split(#k, [#(&#wholes),*]) {
                #size_of_micro
                tchmem::phase::forward();
                #(#body)*
                let #scaled = &#loss * #weight;
                tchmem::phase::backward();
                #backward
                let #part = #scaled.detach();
                #accumulated = Some(match #accumulated {
                    Some(#sum) => #sum + #part,
                    None => #part,
                });
            }
            #accumulated.expect("an empty batch")
        };
    })
}

/// The names in `body` that stand for the batch size: a variable or constant read but not bound
/// there, not a batch tensor, whose name says batch and size (`BATCH_SIZE`, `batch_size`), or is
/// `batch`/`BATCH` itself, in order of first use. Not `NUM_BATCHES` or `batch_idx`: counts of
/// batches keep their value.
pub(crate) fn batch_size_names(body: &[Stmt], batch: &[BatchTensor]) -> Vec<Ident> {
    struct Finder(Vec<Ident>);
    impl<'a> Visit<'a> for Finder {
        fn visit_expr_path(&mut self, e: &'a syn::ExprPath) {
            if let Some(ident) = e.path.get_ident() {
                let name = ident.to_string();
                let lower = name.to_lowercase();
                if (lower == "batch" || (lower.contains("batch") && lower.contains("size")))
                    && !self.0.contains(ident)
                {
                    self.0.push(ident.clone());
                }
            }
        }
    }
    let mut finder = Finder(Vec::new());
    body.iter().for_each(|s| finder.visit_stmt(s));
    let bound: Vec<Ident> = body
        .iter()
        .flat_map(let_bindings)
        .map(|b| b.ident)
        .collect();
    finder
        .0
        .into_iter()
        .filter(|name| {
            // `batch` of `for batch in loader { … &batch.images … }` is the batch itself.
            let read_through = batch.iter().any(|t| field_root(&t.whole) == Some(name));
            !batch.iter().any(|t| t.part == *name) && !read_through && !bound.contains(name)
        })
        .collect()
}

/// Replaces the step's reads of batch tensors through fields (`m.train_images`) with the
/// micro-batch's name.
struct ReadParts<'a>(&'a [BatchTensor]);

impl VisitMut for ReadParts<'_> {
    fn visit_expr_mut(&mut self, e: &mut Expr) {
        if let Expr::Field(_) = e {
            let text = compact(e);
            if let Some(tensor) = self.0.iter().find(|t| t.describe() == text) {
                let part = &tensor.part;
                *e = syn::parse_quote!(#part);
                return;
            }
        }
        visit_mut::visit_expr_mut(self, e);
    }
}

/// Replaces reads of the names `from` with `to`.
struct Rename<'a> {
    from: &'a [Ident],
    to: &'a Ident,
}

impl VisitMut for Rename<'_> {
    fn visit_expr_path_mut(&mut self, e: &mut syn::ExprPath) {
        if e.path.get_ident().is_some_and(|i| self.from.contains(i)) {
            e.path = self.to.clone().into();
        }
        visit_mut::visit_expr_path_mut(self, e);
    }
}

/// An assignment in `stmts` to a variable they do not bind (`total += …`): it would run once
/// per micro-batch. Returns the variable and the line.
pub(crate) fn outer_assignment(stmts: &[Stmt]) -> Option<(String, usize)> {
    struct Locals(Vec<String>);
    impl<'a> Visit<'a> for Locals {
        fn visit_local(&mut self, local: &'a syn::Local) {
            self.0
                .extend(bindings(&local.pat).iter().map(|b| b.ident.to_string()));
            visit::visit_local(self, local);
        }
    }
    struct Finder {
        locals: Vec<String>,
        found: Option<(String, usize)>,
    }
    impl Finder {
        fn assigned(&mut self, target: &Expr) {
            let mut root = target;
            loop {
                root = match root {
                    Expr::Field(e) => &e.base,
                    Expr::Index(e) => &e.expr,
                    Expr::Unary(e) => &e.expr,
                    Expr::Paren(e) => &e.expr,
                    _ => break,
                };
            }
            if let Some(ident) = as_ident(root) {
                let name = ident.to_string();
                if !self.locals.contains(&name) && self.found.is_none() {
                    self.found = Some((name, line_of(ident.span())));
                }
            }
        }
    }
    impl<'a> Visit<'a> for Finder {
        fn visit_expr_assign(&mut self, e: &'a syn::ExprAssign) {
            self.assigned(&e.left);
            visit::visit_expr_assign(self, e);
        }
        fn visit_expr_binary(&mut self, e: &'a syn::ExprBinary) {
            if crate::cell_syntax::is_compound_assign(&e.op) {
                self.assigned(&e.left);
            }
            visit::visit_expr_binary(self, e);
        }
        fn visit_expr_closure(&mut self, _: &'a syn::ExprClosure) {}
        fn visit_item(&mut self, _: &'a syn::Item) {}
    }
    let mut locals = Locals(Vec::new());
    stmts.iter().for_each(|s| locals.visit_stmt(s));
    let mut finder = Finder {
        locals: locals.0,
        found: None,
    };
    stmts.iter().for_each(|s| finder.visit_stmt(s));
    finder.found
}
