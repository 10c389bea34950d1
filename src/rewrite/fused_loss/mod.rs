//! `--fused-loss [CHUNK]`: a cross-entropy over a linear head's logits becomes
//! `tchmem::fused_loss`'s, which computes the head and the loss chunk by chunk over the tokens
//! and never makes the logits. The head is found where tch users write it: `h.apply(&head)` or
//! `head.forward(&h)` with `head` an `nn::linear` of the cell (a `let`, or a struct field), a
//! tied head `h.matmul(&wte.ws.tr())`, directly under the loss (through `view`/`reshape`) or
//! bound to a variable that only the loss reads.

use std::collections::BTreeSet;

use proc_macro2::Ident;
use quote::ToTokens;
use syn::visit::{self, Visit};
use syn::visit_mut::{self, VisitMut};
use syn::{Block, Expr, ExprMethodCall, Stmt};

use super::cell::line_of;
use super::change::Change;
use super::earlier::Known;
use super::syntax::{
    as_ident, as_ref_ident, is_nn_path, single_name, strip_parens, unreferenced, Names,
};
use super::Refusal;

mod model_head;

const FLAG: &str = "--fused-loss";

/// Ops between the head and the loss that only reshape (the fused loss flattens by itself).
const RESHAPES: [&str; 4] = ["view", "reshape", "flatten", "contiguous"];

/// The linear layers a cell makes: `let head = nn::linear(…)` (or a call to a function that
/// returns an `nn::Linear`), fields `head: nn::linear(…)` or `head: nn::Linear`.
#[derive(Default)]
struct Linears {
    variables: BTreeSet<String>,
    fields: BTreeSet<String>,
    /// Functions of the cell or of earlier cells that return an `nn::Linear`.
    makers: BTreeSet<String>,
}

impl Linears {
    fn of(block: &Block, known: &Known) -> Linears {
        let functions = &known.functions;
        struct Makers(BTreeSet<String>);
        impl<'a> Visit<'a> for Makers {
            fn visit_item_fn(&mut self, item: &'a syn::ItemFn) {
                if returns_linear(&item.sig) {
                    self.0.insert(item.sig.ident.to_string());
                }
                visit::visit_item_fn(self, item);
            }
        }
        let mut makers = Makers(BTreeSet::new());
        makers.visit_block(block);
        for function in functions.iter() {
            if let Ok(item) = syn::parse_str::<syn::ItemFn>(&function.code) {
                makers.visit_item_fn(&item);
            }
        }
        struct Finder(Linears);
        impl<'a> Visit<'a> for Finder {
            fn visit_local(&mut self, local: &'a syn::Local) {
                if let (Some(name), Some(init)) = (single_name(&local.pat), &local.init) {
                    if self.0.makes(&init.expr) {
                        self.0.variables.insert(name);
                    }
                }
                visit::visit_local(self, local);
            }
            fn visit_field_value(&mut self, field: &'a syn::FieldValue) {
                if let syn::Member::Named(name) = &field.member {
                    if self.0.makes(&field.expr) {
                        self.0.fields.insert(name.to_string());
                    }
                }
                visit::visit_field_value(self, field);
            }
            fn visit_field(&mut self, field: &'a syn::Field) {
                if let (Some(name), syn::Type::Path(ty)) = (&field.ident, &field.ty) {
                    if is_linear_type(&ty.path) {
                        self.0.fields.insert(name.to_string());
                    }
                }
                visit::visit_field(self, field);
            }
        }
        let mut finder = Finder(Linears {
            makers: makers.0,
            variables: known.linears.iter().cloned().collect(),
            ..Linears::default()
        });
        finder.visit_block(block);
        finder.0
    }

    /// Whether `expr` (`head`, `&head`, `self.head`) is one of them.
    fn is_linear(&self, expr: &Expr) -> bool {
        match unreferenced(expr) {
            Expr::Field(field) => match &field.member {
                syn::Member::Named(name) => self.fields.contains(&name.to_string()),
                syn::Member::Unnamed(_) => false,
            },
            other => as_ident(other).is_some_and(|name| self.variables.contains(&name.to_string())),
        }
    }

    /// Whether `expr` makes a linear layer: `nn::linear(…)` or a call to one of `makers`,
    /// perhaps with `?` after it.
    fn makes(&self, expr: &Expr) -> bool {
        match strip_parens(expr) {
            Expr::Try(inner) => self.makes(&inner.expr),
            Expr::Call(call) => match &*call.func {
                Expr::Path(path) => {
                    is_nn_path(&path.path, &["linear"])
                        || path
                            .path
                            .get_ident()
                            .is_some_and(|f| self.makers.contains(&f.to_string()))
                }
                _ => false,
            },
            _ => false,
        }
    }
}

/// `nn::Linear` or `Linear`.
fn is_linear_type(path: &syn::Path) -> bool {
    is_nn_path(path, &["Linear"]) || path.is_ident("Linear")
}

/// Whether a function returns an `nn::Linear`.
fn returns_linear(sig: &syn::Signature) -> bool {
    matches!(&sig.output, syn::ReturnType::Type(_, ty)
        if matches!(&**ty, syn::Type::Path(p) if is_linear_type(&p.path)))
}

/// Where the fused loss finds the head and its input.
// A few per cell, short-lived: boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
enum Head {
    /// A head the cell applies itself: the hidden states, the weight and the bias.
    Shown {
        hidden: Expr,
        weight: Expr,
        bias: Option<Expr>,
    },
    /// A model's output (`model.forward_t(&x, true)`): the head is the model's last layer,
    /// marked where the model is built ([`model_head`]), and the forward pass runs inside
    /// `tchmem::fused_loss::split_head`.
    Inside { forward: Expr, model: Ident },
    /// A variable holding such a forward pass's `split_head`.
    Split { logits: Ident, model: Ident },
}

/// The model whose forward pass `expr` is: `model.forward_t(&x, train)`, `model.forward(&x)`,
/// `x.apply_t(&model, train)`, `x.apply(&model)`.
fn model_of(expr: &Expr) -> Option<Ident> {
    let Expr::MethodCall(call) = strip_parens(expr) else {
        return None;
    };
    let model = match (call.method.to_string().as_str(), call.args.len()) {
        ("forward", 1) | ("forward_t", 2) => as_ident(&call.receiver),
        ("apply", 1) | ("apply_t", 2) => as_ref_ident(&call.args[0]),
        _ => None,
    };
    model.cloned()
}

/// The head whose logits `expr` is, if it is one.
fn head_of(expr: &Expr, linears: &Linears) -> Option<Head> {
    let Expr::MethodCall(call) = strip_parens(expr) else {
        return None;
    };
    let linear = |layer: &Expr, hidden: &Expr| {
        let layer = unreferenced(layer);
        Head::Shown {
            hidden: hidden.clone(),
            weight: syn::parse_quote!(#layer.ws),
            bias: Some(syn::parse_quote!(#layer.bs.as_ref())),
        }
    };
    match (call.method.to_string().as_str(), call.args.len()) {
        ("apply", 1) if linears.is_linear(&call.args[0]) => {
            Some(linear(&call.args[0], &call.receiver))
        }
        ("forward", 1) if linears.is_linear(&call.receiver) => {
            let hidden = match strip_parens(&call.args[0]) {
                Expr::Reference(r) if r.mutability.is_none() => &*r.expr,
                other => other,
            };
            Some(linear(&call.receiver, hidden))
        }
        // A tied head: `h.matmul(&wte.ws.tr())`.
        ("matmul", 1) => {
            let Expr::MethodCall(transposed) = unreferenced(&call.args[0]) else {
                return None;
            };
            let transposes = match transposed.method.to_string().as_str() {
                "tr" | "t" | "t_copy" => transposed.args.is_empty(),
                "transpose" => transposed.args.len() == 2,
                _ => false,
            };
            let weight = &transposed.receiver;
            transposes.then(|| Head::Shown {
                hidden: (*call.receiver).clone(),
                weight: (**weight).clone(),
                bias: None,
            })
        }
        _ => None,
    }
}

/// The logits expression under a cross-entropy call, past reshapes, and the loss's settings.
struct Loss<'a> {
    logits: &'a Expr,
    targets: &'a Expr,
    /// The ignored class, when not -100.
    ignore_index: Option<Expr>,
}

/// `logits.cross_entropy_for_logits(&y)`, or `logits.cross_entropy_loss(&y, None, Mean, i,
/// 0.0)`, past reshapes of the logits; `Err` with why for a `cross_entropy_loss` whose settings
/// the fused loss does not have.
fn as_loss(call: &ExprMethodCall) -> Option<Result<Loss<'_>, String>> {
    let method = call.method.to_string();
    let ignore_index = match (method.as_str(), call.args.len()) {
        ("cross_entropy_for_logits", 1) => None,
        ("cross_entropy_loss", 5) => {
            let text = |i: usize| call.args[i].to_token_stream().to_string().replace(' ', "");
            let mean = text(2).ends_with("Mean");
            let smoothing_text = text(4);
            let smoothing = smoothing_text.trim_end_matches("f64").trim_end_matches('0');
            if text(1) != "None::<Tensor>" && text(1) != "None" || !mean || smoothing != "0." {
                return Some(Err(
                    "a cross_entropy_loss with class weights, another reduction than Mean or \
                     label smoothing (the fused loss has the mean over targets, an ignored \
                     class, nothing more)"
                        .to_string(),
                ));
            }
            let ignore = text(3);
            (ignore != "-100").then(|| call.args[3].clone())
        }
        _ => return None,
    };
    let mut logits = &*call.receiver;
    while let Expr::MethodCall(inner) = strip_parens(logits) {
        if !RESHAPES.contains(&inner.method.to_string().as_str()) {
            break;
        }
        logits = &inner.receiver;
    }
    Some(Ok(Loss {
        logits,
        targets: &call.args[0],
        ignore_index,
    }))
}

/// The fused loss's call.
fn fused_call(head: &Head, targets: &Expr, chunk: Option<u32>, ignore: Option<&Expr>) -> Expr {
    let default = chunk.is_none() && ignore.is_none();
    let split: Expr = match head {
        Head::Shown {
            hidden,
            weight,
            bias,
        } => {
            let bias: Expr = match bias {
                Some(bias) => bias.clone(),
                None => syn::parse_quote!(None),
            };
            let (hidden, weight) = (borrowed(hidden), borrowed(weight));
            if default {
                return syn::parse_quote!(
                    tchmem::fused_loss::linear_cross_entropy(#hidden, #weight, #bias, #targets)
                );
            }
            let config = loss_config(chunk, ignore);
            return syn::parse_quote!(#config.loss(#hidden, #weight, #bias, #targets));
        }
        Head::Inside { forward, .. } => {
            syn::parse_quote!(tchmem::fused_loss::split_head(|| #forward))
        }
        Head::Split { logits, .. } => syn::parse_quote!(#logits),
    };
    if default {
        return syn::parse_quote!(#split.cross_entropy(#targets));
    }
    let config = loss_config(chunk, ignore);
    syn::parse_quote!(#config.loss_of(&#split, #targets))
}

/// `tchmem::fused_loss::FusedLoss::default()` with the chunk and ignored class set.
fn loss_config(chunk: Option<u32>, ignore: Option<&Expr>) -> Expr {
    let mut config: Expr = syn::parse_quote!(tchmem::fused_loss::FusedLoss::default());
    if let Some(chunk) = chunk {
        let chunk = proc_macro2::Literal::i64_unsuffixed(i64::from(chunk));
        config = syn::parse_quote!(#config.chunk(#chunk));
    }
    if let Some(ignore) = ignore {
        config = syn::parse_quote!(#config.ignore_index(#ignore));
    }
    config
}

/// `&expr`, or `expr` itself when it is a reference already.
fn borrowed(expr: &Expr) -> Expr {
    match strip_parens(expr) {
        Expr::Reference(_) => expr.clone(),
        _ => syn::parse_quote!(&#expr),
    }
}

/// The models whose forward pass a cross-entropy of `block` takes (directly or through a
/// variable) where no head of the block is shown.
pub(crate) fn models_under_loss(block: &Block) -> Vec<String> {
    struct Finder<'l> {
        linears: &'l Linears,
        /// Variables bound to a model's forward pass, and the model.
        forwards: Vec<(String, String)>,
        found: Vec<String>,
    }
    impl Finder<'_> {
        fn model(&self, expr: &Expr) -> Option<String> {
            (head_of(expr, self.linears).is_none())
                .then(|| model_of(expr).map(|m| m.to_string()))
                .flatten()
        }
    }
    impl<'a> Visit<'a> for Finder<'_> {
        fn visit_local(&mut self, local: &'a syn::Local) {
            if let (Some(name), Some(init)) = (single_name(&local.pat), &local.init) {
                if let Some(model) = self.model(&init.expr) {
                    self.forwards.push((name, model));
                }
            }
            visit::visit_local(self, local);
        }
        fn visit_expr_method_call(&mut self, call: &'a ExprMethodCall) {
            if let Some(Ok(loss)) = as_loss(call) {
                let bound = as_ident(loss.logits).and_then(|name| {
                    self.forwards
                        .iter()
                        .rev()
                        .find(|(bound, _)| name == bound)
                        .map(|(_, model)| model.clone())
                });
                if let Some(model) = bound.or_else(|| self.model(loss.logits)) {
                    if !self.found.contains(&model) {
                        self.found.push(model);
                    }
                }
            }
            visit::visit_expr_method_call(self, call);
        }
    }
    let linears = Linears::of(block, &Known::default());
    let mut finder = Finder {
        linears: &linears,
        forwards: Vec::new(),
        found: Vec::new(),
    };
    finder.visit_block(block);
    finder.found
}

/// Rewrites every cross-entropy over a linear head's logits in the cell.
///
/// `known` is what the earlier cells hold: a head of theirs the cell applies, functions that
/// build a model (its head is marked there, [`model_head`]).
pub(crate) fn apply(
    block: &mut Block,
    chunk: Option<u32>,
    names: &mut Names,
    known: &Known,
    changes: &mut Vec<Change>,
) -> Result<(), Refusal> {
    let linears = Linears::of(block, known);
    let mut fuser = Fuser {
        linears: &linears,
        chunk,
        names,
        done: Vec::new(),
        missed: None,
    };
    fuser.visit_block_mut(block);
    let (done, missed) = (fuser.done, fuser.missed);
    // The models whose output a rewritten loss takes: their heads are marked where they are built.
    let mut marked: Vec<&Ident> = Vec::new();
    for (line, _, model) in &done {
        let Some(model) = model.as_ref().filter(|m| !marked.contains(m)) else {
            continue;
        };
        model_head::mark(block, model, known, changes)
            .map_err(|why| Refusal::at(*line, format!("{FLAG}: {why}")))?;
        marked.push(model);
    }
    let how = match chunk {
        Some(n) => format!("{n} tokens per chunk"),
        None => "chunks sized by the vocabulary".to_string(),
    };
    if done.is_empty() {
        return Err(match missed {
            Some((line, why)) => Refusal::at(line, format!("{FLAG}: {why}")),
            None => Refusal::new(
                format!(
                    "{FLAG} looks for a cross-entropy over a linear head's logits in this cell: \
                     `h.apply(&head).cross_entropy_for_logits(&y)` or `head.forward(&h)…` with \
                     `head` an nn::linear of the cell, a tied head `h.matmul(&wte.ws.tr())`, or \
                     a model's output (`model.forward_t(&x, true)…`) whose last layer is such a \
                     head; found none"
                ),
                None,
            ),
        });
    }
    for (line, head, _) in done {
        changes.push(Change::at(
            line,
            format!(
                "{FLAG}: {head} and the cross-entropy → tchmem::fused_loss ({how}): the loss and \
                 its gradients computed chunk by chunk in the forward pass, no logits tensor in \
                 forward or backward"
            ),
        ));
    }
    Ok(())
}

struct Fuser<'a> {
    linears: &'a Linears,
    chunk: Option<u32>,
    names: &'a mut Names,
    /// Line, head and model (a head inside a model) of each loss rewritten.
    done: Vec<(usize, String, Option<Ident>)>,
    /// The first loss found that could not be rewritten, and why.
    missed: Option<(usize, String)>,
}

impl Fuser<'_> {
    fn miss(&mut self, line: usize, why: String) {
        if self.missed.is_none() {
            self.missed = Some((line, why));
        }
    }

    /// The loss `expr` rewritten, if it is one over a head's logits; `bound` is the head of a
    /// variable the loss reads (`let logits = h.apply(&head);`), renamed to the hidden states.
    fn fuse(&mut self, expr: &Expr, bound: Option<(&Ident, &Head)>) -> Option<Expr> {
        let Expr::MethodCall(call) = expr else {
            return None;
        };
        let line = line_of(call.method.span());
        let loss = match as_loss(call)? {
            Ok(loss) => loss,
            Err(why) => {
                self.miss(line, why);
                return None;
            }
        };
        let model = model_of(loss.logits);
        let head = match (head_of(loss.logits, self.linears), bound, model) {
            (Some(head), _, _) => head,
            (None, Some((name, head)), _) if as_ident(loss.logits) == Some(name) => head.clone(),
            (None, _, Some(model)) => Head::Inside {
                forward: loss.logits.clone(),
                model,
            },
            _ => {
                let logits = loss.logits.to_token_stream().to_string();
                self.miss(
                    line,
                    format!(
                        "the loss takes `{logits}`, which is neither a linear head's output this \
                         cell shows nor a model's forward pass (`model.forward_t(&x, true)`): \
                         the fused loss needs the hidden states and the head apart. Write the \
                         loss as `h.apply(&head).cross_entropy_for_logits(&y)` (`head` an \
                         nn::linear of this cell), `h.matmul(&wte.ws.tr())` for a tied head, or \
                         over the model's forward pass"
                    ),
                );
                return None;
            }
        };
        let what = describe(&head);
        let model = match &head {
            Head::Inside { model, .. } | Head::Split { model, .. } => Some(model.clone()),
            Head::Shown { .. } => None,
        };
        self.done.push((line, what, model));
        Some(fused_call(
            &head,
            loss.targets,
            self.chunk,
            loss.ignore_index.as_ref(),
        ))
    }
}

fn describe(head: &Head) -> String {
    match head {
        Head::Shown { weight, bias, .. } => {
            let weight = weight.to_token_stream().to_string().replace(' ', "");
            match bias {
                Some(_) => format!("the head `{}`", weight.trim_end_matches(".ws")),
                None => format!("the tied head `{weight}`"),
            }
        }
        Head::Inside { model, .. } | Head::Split { model, .. } => {
            format!("the head inside `{model}`")
        }
    }
}

impl VisitMut for Fuser<'_> {
    fn visit_block_mut(&mut self, block: &mut Block) {
        // `let logits = h.apply(&head);` read only by the loss: bind the hidden states instead.
        let mut next = 0;
        while next < block.stmts.len() {
            let i = next;
            next += 1;
            let Some((name, head)) = bound_head(&block.stmts[i], self.linears) else {
                continue;
            };
            let uses: usize = block.stmts[i + 1..]
                .iter()
                .map(|s| count_uses(s, &name))
                .sum();
            // `let logits = h.apply(&head);` right above the loss: the loss reads `h` itself and
            // the statement goes. Otherwise the statement binds a reference to the hidden states
            // under a new name (so that nothing between reads another `h`, and nothing moves).
            // A model's forward pass keeps its name and runs inside split_head.
            let hidden = match &head {
                Head::Shown { hidden, .. } => Some(hidden.clone()),
                Head::Inside { .. } | Head::Split { .. } => None,
            };
            let direct = hidden
                .as_ref()
                .and_then(as_ident)
                .filter(|_| block.stmts.get(i + 1).is_some_and(|s| loss_reads(s, &name)))
                .cloned();
            let mut renamed = match &hidden {
                Some(_) => direct.clone().unwrap_or_else(|| self.names.fresh("hidden")),
                None => name.clone(),
            };
            renamed.set_span(name.span());
            let mut rewriter = BoundLoss {
                fuser: self,
                name: &name,
                renamed: &renamed,
                head: &head,
                rewrote: false,
            };
            let mut later: Vec<Stmt> = block.stmts[i + 1..].to_vec();
            for stmt in &mut later {
                rewriter.visit_stmt_mut(stmt);
            }
            if !rewriter.rewrote {
                continue;
            }
            if uses > 1 {
                let line = line_of(name.span());
                self.done.pop();
                self.miss(
                    line,
                    format!(
                        "`{name}` (the logits) is read by more than the loss; the fused loss never \
                         makes them: compute what else reads them apart (under no_grad), or \
                         leave {FLAG} out"
                    ),
                );
                continue;
            }
            block.stmts.splice(i + 1.., later);
            if direct.is_some() {
                block.stmts.remove(i);
                next = i;
                continue;
            }
            let Stmt::Local(local) = &mut block.stmts[i] else {
                continue;
            };
            let Some(hidden) = hidden else {
                if let Some(init) = &mut local.init {
                    let forward = &init.expr;
                    *init.expr = syn::parse_quote!(tchmem::fused_loss::split_head(|| #forward));
                }
                continue;
            };
            {
                local.pat = syn::Pat::Ident(syn::PatIdent {
                    attrs: Vec::new(),
                    by_ref: None,
                    mutability: None,
                    ident: renamed.clone(),
                    subpat: None,
                });
                if let Some(init) = &mut local.init {
                    *init.expr = syn::parse_quote!(&(#hidden));
                }
            }
        }
        visit_mut::visit_block_mut(self, block);
    }

    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        visit_mut::visit_expr_mut(self, expr);
        if let Some(fused) = self.fuse(expr, None) {
            *expr = fused;
        }
    }
}

/// Rewrites the loss that reads a bound head's logits.
struct BoundLoss<'f, 'a> {
    fuser: &'f mut Fuser<'a>,
    name: &'f Ident,
    renamed: &'f Ident,
    head: &'f Head,
    rewrote: bool,
}

impl VisitMut for BoundLoss<'_, '_> {
    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        visit_mut::visit_expr_mut(self, expr);
        if self.rewrote {
            return;
        }
        let Expr::MethodCall(call) = &*expr else {
            return;
        };
        let reads_it = as_loss(call)
            .and_then(Result::ok)
            .is_some_and(|loss| as_ident(loss.logits) == Some(self.name));
        if !reads_it {
            return;
        }
        let renamed = self.renamed;
        let head = match self.head {
            Head::Shown { weight, bias, .. } => Head::Shown {
                hidden: syn::parse_quote!(#renamed),
                weight: weight.clone(),
                bias: bias.clone(),
            },
            Head::Inside { model, .. } | Head::Split { model, .. } => Head::Split {
                logits: renamed.clone(),
                model: model.clone(),
            },
        };
        if let Some(fused) = self.fuser.fuse(expr, Some((self.name, &head))) {
            *expr = fused;
            self.rewrote = true;
        }
    }
}

/// `let logits = <head>;` → the name and the head.
fn bound_head(stmt: &Stmt, linears: &Linears) -> Option<(Ident, Head)> {
    let Stmt::Local(local) = stmt else {
        return None;
    };
    let name = match &local.pat {
        syn::Pat::Ident(p) => p.ident.clone(),
        syn::Pat::Type(t) => match &*t.pat {
            syn::Pat::Ident(p) => p.ident.clone(),
            _ => return None,
        },
        _ => return None,
    };
    let init = &local.init.as_ref()?.expr;
    let head = head_of(init, linears).or_else(|| {
        model_of(init).map(|model| Head::Inside {
            forward: (**init).clone(),
            model,
        })
    })?;
    Some((name, head))
}

/// How often `stmt` names `name`, format strings' captures (`{logits:?}`) included.
fn count_uses(stmt: &Stmt, name: &Ident) -> usize {
    let captured = [format!("{{{name}}}"), format!("{{{name}:")];
    let mut count = 0;
    super::syntax::walk_tokens(stmt.to_token_stream(), &mut |tree| match tree {
        proc_macro2::TokenTree::Ident(ident) if ident == name => count += 1,
        proc_macro2::TokenTree::Literal(literal) => {
            let text = literal.to_string();
            count += captured
                .iter()
                .map(|c| text.matches(c.as_str()).count())
                .sum::<usize>();
        }
        _ => {}
    });
    count
}

/// Whether `stmt` holds a cross-entropy over the logits bound to `name`.
fn loss_reads(stmt: &Stmt, name: &Ident) -> bool {
    struct Finder<'n> {
        name: &'n Ident,
        found: bool,
    }
    impl<'a> Visit<'a> for Finder<'_> {
        fn visit_expr_method_call(&mut self, call: &'a ExprMethodCall) {
            let reads = as_loss(call)
                .and_then(Result::ok)
                .is_some_and(|loss| as_ident(loss.logits) == Some(self.name));
            self.found |= reads;
            visit::visit_expr_method_call(self, call);
        }
    }
    let mut finder = Finder { name, found: false };
    finder.visit_stmt(stmt);
    finder.found
}
