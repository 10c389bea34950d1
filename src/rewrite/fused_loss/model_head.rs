//! A head inside the model: the loss takes a model's output (`model.forward_t(&x, true)`), so
//! the head is where the model is built. The model's definition is followed from the `let` that
//! binds it, through the functions that build it (`gpt(vs.root(), cfg)` → `nn::func_t(move
//! |xs, train| … .apply(&head))`), to its last layer, which is marked for the fused loss
//! (`tchmem::fused_loss::SplitHead`, `tied_head`): the model stays what it was everywhere else,
//! and inside `split_head` hands its hidden states and weights to the loss.
//!
//! Followed: a `let` of the cell (or one rebuilt from an earlier cell), functions of the cell
//! or of earlier cells (an earlier one is redefined in the cell with its head marked), a
//! function's tail or the `let` its tail names, `nn::func`/`nn::func_t` closures, `nn::seq()`
//! chains whose last layer is an `nn::linear`, and `impl Module`/`ModuleT` for a struct of the
//! cell.

use syn::visit_mut::{self, VisitMut};
use syn::{Block, Expr, Ident, Stmt};

use super::super::earlier::{EarlierFn, Known};
use super::super::syntax::{
    as_ident, is_nn_path, segments, single_name, strip_parens, unreferenced,
};
use super::Linears;
use crate::rewrite::cell::pretty;
use crate::rewrite::change::Change;

/// How many definitions are followed before giving up (a model built by a function that calls
/// itself, say).
const MAX_DEPTH: usize = 8;

/// Where the model's output is made.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Site {
    /// The value of the `let` binding this name.
    Let(String),
    /// The value a function returns.
    Function(String),
    /// The forward pass of `impl Module`/`ModuleT` for this type.
    Impl(String),
}

/// What the expression at a site turned out to be.
enum Tail {
    /// The head, now marked: what it is.
    Marked(String),
    /// Made at another site.
    Elsewhere(Site),
    /// Nothing that is a linear head: the expression.
    Other(String),
    /// Built by a library's function (`resnet::resnet18(…)`): its path.
    Library(String),
}

/// Marks the output head of `model` (a variable whose forward pass the loss takes) in `block`,
/// bringing in functions of earlier cells it must change. `Err` says why it could not.
pub(super) fn mark(
    block: &mut Block,
    model: &Ident,
    known: &Known,
    changes: &mut Vec<Change>,
) -> Result<(), String> {
    let mut site = Site::Let(model.to_string());
    let mut path = vec![format!("`{model}`")];
    let mut linears = Linears::of(block, known);
    for _ in 0..MAX_DEPTH {
        let tail = match at_site(block, &site, &linears) {
            Some(tail) => tail,
            None => {
                // A function of an earlier cell: redefined in the cell, where it can be marked.
                let earlier = match &site {
                    Site::Function(name) => known.functions.iter().find(|f| &f.name == name),
                    _ => None,
                };
                let Some(earlier) = earlier else {
                    return Err(not_found(&site, &path));
                };
                bring_in(block, earlier)?;
                changes.push(Change::general(format!(
                    "--fused-loss: `fn {}` of cell [{}] is redefined in this cell with its head \
                     marked (the same function elsewhere: the mark only acts inside the fused \
                     loss)",
                    earlier.name, earlier.run
                )));
                linears = Linears::of(block, known);
                at_site(block, &site, &linears).ok_or_else(|| not_found(&site, &path))?
            }
        };
        match tail {
            Tail::Marked(what) => {
                changes.push(Change::general(format!(
                    "--fused-loss: {what}, the last layer of {}, marked with \
                     tchmem::fused_loss::SplitHead: it is the head as before everywhere, and \
                     inside `split_head` gives the fused loss its input and weights instead of \
                     the logits",
                    path.join(" → ")
                )));
                return Ok(());
            }
            Tail::Elsewhere(next) => {
                path.push(match &next {
                    Site::Let(name) => format!("`{name}`"),
                    Site::Function(name) => format!("`{name}(…)`"),
                    Site::Impl(ty) => format!("`{ty}`'s forward"),
                });
                site = next;
            }
            Tail::Library(function) => {
                return Err(format!(
                    "the loss takes the output of {}, built by `{function}`, a library's model \
                     whose layers the rewriter cannot mark: build the model in the notebook \
                     (its last layer an nn::linear) to fuse its loss",
                    path.join(" → ")
                ))
            }
            Tail::Other(text) => {
                return Err(format!(
                    "the loss takes the output of {}, which ends in `{text}`, not a linear head \
                     (an nn::linear applied last, or `x.matmul(&w.tr())`): the fused loss needs \
                     the head apart from the hidden states",
                    path.join(" → ")
                ))
            }
        }
    }
    Err(format!(
        "the model's definition goes on past {}; mark its head yourself \
         (tchmem::fused_loss::SplitHead around the last nn::linear)",
        path.join(" → ")
    ))
}

fn not_found(site: &Site, path: &[String]) -> String {
    let what = match site {
        Site::Let(name) => format!("the `let` that builds `{name}`"),
        Site::Function(name) => format!("`fn {name}`"),
        Site::Impl(ty) => format!("`impl Module for {ty}` (or ModuleT)"),
    };
    format!(
        "the loss takes the output of {}, and the rewriter cannot see {what} (it reads this \
         cell, the functions of earlier cells and a model rebuilt from them; an impl of an \
         earlier cell is not rewritten): mark the head yourself \
         (tchmem::fused_loss::SplitHead around the model's last nn::linear) or define it here",
        path.join(" → ")
    )
}

/// Brings an earlier cell's function into the cell, in front of its statements.
fn bring_in(block: &mut Block, earlier: &EarlierFn) -> Result<(), String> {
    let item: syn::Item = syn::parse_str(&earlier.code).map_err(|e| {
        format!(
            "`fn {}` of cell [{}] does not parse: {e}",
            earlier.name, earlier.run
        )
    })?;
    block.stmts.insert(0, Stmt::Item(item));
    Ok(())
}

/// Marks the head at `site` in `block`, if the site is there.
fn at_site(block: &mut Block, site: &Site, linears: &Linears) -> Option<Tail> {
    // A model is a `let` of the cell's top level (a rebuilt one too), not one of a function's
    // own variables.
    if let Site::Let(name) = site {
        return let_init(block, name).map(|init| mark_tail(init, linears));
    }
    let mut finder = SiteFinder {
        site,
        linears,
        tail: None,
    };
    finder.visit_block_mut(block);
    finder.tail
}

/// Finds a function or an impl's forward anywhere in the cell (a rebuilt model's functions are
/// inside its block).
struct SiteFinder<'a> {
    site: &'a Site,
    linears: &'a Linears,
    tail: Option<Tail>,
}

impl VisitMut for SiteFinder<'_> {
    fn visit_item_fn_mut(&mut self, item: &mut syn::ItemFn) {
        if self.tail.is_none()
            && matches!(self.site, Site::Function(name) if item.sig.ident == name)
        {
            self.tail = Some(mark_block(&mut item.block, self.linears));
            return;
        }
        visit_mut::visit_item_fn_mut(self, item);
    }

    fn visit_item_impl_mut(&mut self, item: &mut syn::ItemImpl) {
        let Site::Impl(ty) = self.site else {
            return visit_mut::visit_item_impl_mut(self, item);
        };
        let is_module = item.trait_.as_ref().is_some_and(|(_, path, _)| {
            path.segments
                .last()
                .is_some_and(|s| s.ident == "Module" || s.ident == "ModuleT")
        });
        let for_type = matches!(&*item.self_ty, syn::Type::Path(p) if p.path.is_ident(ty));
        if self.tail.is_some() || !is_module || !for_type {
            return visit_mut::visit_item_impl_mut(self, item);
        }
        for member in &mut item.items {
            if let syn::ImplItem::Fn(method) = member {
                if method.sig.ident == "forward" || method.sig.ident == "forward_t" {
                    self.tail = Some(mark_block(&mut method.block, self.linears));
                    return;
                }
            }
        }
    }
}

/// The tail of a block: its last expression, or the `let` of the variable it names.
fn mark_block(block: &mut Block, linears: &Linears) -> Tail {
    let Some(Stmt::Expr(tail, None)) = block.stmts.last() else {
        return Tail::Other("no value at the end of the block".to_string());
    };
    if let Some(name) = as_ident(tail).map(ToString::to_string) {
        match variable_value(block, &name) {
            Ok(Some(value)) => return mark_tail(value, linears),
            Ok(None) => {}
            Err(why) => return Tail::Other(why),
        }
    }
    match block.stmts.last_mut() {
        Some(Stmt::Expr(tail, None)) => mark_tail(tail, linears),
        _ => unreachable!("checked above"),
    }
}

/// The value a block's variable `name` ends with: its last `let`'s, or that of the last
/// assignment after it among the block's statements (`x = x.relu().apply(&l2);`); `Err` when it
/// is reassigned inside a loop or a block after that (what it ends with cannot be read off).
fn variable_value<'b>(block: &'b mut Block, name: &str) -> Result<Option<&'b mut Expr>, String> {
    let binds = |stmt: &Stmt| matches!(stmt, Stmt::Local(local) if single_name(&local.pat).as_deref() == Some(name));
    let assigns = |stmt: &Stmt| {
        matches!(stmt, Stmt::Expr(Expr::Assign(a), _)
            if as_ident(&a.left).is_some_and(|left| left == name))
    };
    let Some(bound) = block.stmts.iter().rposition(binds) else {
        return Ok(None);
    };
    let last = (bound + 1..block.stmts.len())
        .rev()
        .find(|&i| assigns(&block.stmts[i]))
        .unwrap_or(bound);
    if block.stmts[last + 1..]
        .iter()
        .any(|stmt| assigns_inside(stmt, name))
    {
        return Err(format!("`{name}`, reassigned inside a loop or a block"));
    }
    Ok(match &mut block.stmts[last] {
        Stmt::Expr(Expr::Assign(assign), _) => Some(&mut *assign.right),
        Stmt::Local(local) => local.init.as_mut().map(|init| &mut *init.expr),
        _ => None,
    })
}

/// Whether `stmt` assigns `name` somewhere inside it.
fn assigns_inside(stmt: &Stmt, name: &str) -> bool {
    struct Finder<'n>(&'n str, bool);
    impl<'a> syn::visit::Visit<'a> for Finder<'_> {
        fn visit_expr_assign(&mut self, assign: &'a syn::ExprAssign) {
            self.1 |= as_ident(&assign.left).is_some_and(|left| left == self.0);
            syn::visit::visit_expr_assign(self, assign);
        }
    }
    let mut finder = Finder(name, false);
    syn::visit::Visit::visit_stmt(&mut finder, stmt);
    finder.1
}

/// The value of the last `let` of `name` among the block's statements.
fn let_init<'b>(block: &'b mut Block, name: &str) -> Option<&'b mut Expr> {
    block.stmts.iter_mut().rev().find_map(|stmt| match stmt {
        Stmt::Local(local) if single_name(&local.pat).as_deref() == Some(name) => {
            local.init.as_mut().map(|init| &mut *init.expr)
        }
        _ => None,
    })
}

/// Marks the head `expr` ends in, or says where its value is made.
fn mark_tail(expr: &mut Expr, linears: &Linears) -> Tail {
    if matches!(&*expr, Expr::Call(_)) && is_marked(expr) {
        return Tail::Marked(expr_text(expr));
    }
    if let Some((hidden, weight)) = tied(expr) {
        let what = format!("the tied head `{}`", expr_text(&weight));
        let (hidden, weight) = (super::borrowed(&hidden), super::borrowed(&weight));
        *expr = syn::parse_quote!(tchmem::fused_loss::tied_head(#hidden, #weight));
        return Tail::Marked(what);
    }
    let text = expr_text(expr);
    let text = || text.clone();
    match expr {
        Expr::Paren(inner) => mark_tail(&mut inner.expr, linears),
        Expr::Block(inner) => mark_block(&mut inner.block, linears),
        Expr::Try(inner) => mark_tail(&mut inner.expr, linears),
        Expr::Closure(closure) => mark_tail(&mut closure.body, linears),
        Expr::Struct(literal) => match literal.path.get_ident() {
            Some(ty) => Tail::Elsewhere(Site::Impl(ty.to_string())),
            None => Tail::Other(text()),
        },
        Expr::Call(call) => {
            let Expr::Path(func) = &*call.func else {
                return Tail::Other(text());
            };
            let names = segments(&func.path);
            if is_nn_path(&func.path, &["func_t"]) || is_nn_path(&func.path, &["func"]) {
                let single = call.args.len() == 1;
                return match call.args.first_mut() {
                    Some(closure) if single => mark_tail(closure, linears),
                    _ => Tail::Other(text()),
                };
            }
            match names.as_slice() {
                [only] if only == "Ok" || only == "Some" => match call.args.first_mut() {
                    Some(value) => mark_tail(value, linears),
                    None => Tail::Other(text()),
                },
                [function] if function.starts_with(char::is_lowercase) => {
                    Tail::Elsewhere(Site::Function(function.clone()))
                }
                [ty, _] if ty.starts_with(char::is_uppercase) => {
                    Tail::Elsewhere(Site::Impl(ty.clone()))
                }
                // `resnet::resnet18(…)`: a library's model, its layers out of reach.
                [_, _, ..] if names.iter().all(|n| n.starts_with(char::is_lowercase)) => {
                    Tail::Library(format!("{}(…)", names.join("::")))
                }
                _ => Tail::Other(text()),
            }
        }
        Expr::MethodCall(call) => mark_method(call, linears).unwrap_or_else(|| {
            let method = call.method.to_string();
            // `make(…).unwrap()`: the call's value.
            if matches!(method.as_str(), "unwrap" | "expect") {
                mark_tail(&mut call.receiver, linears)
            } else {
                Tail::Other(text())
            }
        }),
        _ => Tail::Other(text()),
    }
}

/// A head at the end of a method chain, marked: `.apply(&head)`, `head.forward(&x)`, or
/// `.add(nn::linear(…))` ending an `nn::seq()`.
fn mark_method(call: &mut syn::ExprMethodCall, linears: &Linears) -> Option<Tail> {
    let method = call.method.to_string();
    let one_arg = call.args.len() == 1;
    match method.as_str() {
        // Marked already (a model that two lets build with one function).
        "apply" | "add" if one_arg && is_marked(&call.args[0]) => {
            Some(Tail::Marked(expr_text(&call.args[0])))
        }
        "forward" if one_arg && is_marked(&call.receiver) => {
            Some(Tail::Marked(expr_text(&call.receiver)))
        }
        "apply" if one_arg && linears.is_linear(&call.args[0]) => {
            let layer = unreferenced(&call.args[0]).clone();
            call.args[0] = syn::parse_quote!(&tchmem::fused_loss::SplitHead::of(&#layer));
            Some(Tail::Marked(format!("`{}`", expr_text(&layer))))
        }
        "forward" if one_arg && linears.is_linear(&call.receiver) => {
            let layer = unreferenced(&call.receiver).clone();
            *call.receiver = syn::parse_quote!(tchmem::fused_loss::SplitHead::of(&#layer));
            Some(Tail::Marked(format!("`{}`", expr_text(&layer))))
        }
        "add" if one_arg && linears.makes(&call.args[0]) => {
            let layer = call.args[0].clone();
            let what = format!("`{}`", expr_text(&layer));
            call.args[0] = syn::parse_quote!(tchmem::fused_loss::SplitHead(#layer));
            Some(Tail::Marked(what))
        }
        _ => None,
    }
}

/// `x.matmul(&w.tr())` → (`x`, `w`).
fn tied(expr: &Expr) -> Option<(Expr, Expr)> {
    match super::head_of(expr, &Linears::default())? {
        super::Head::Shown {
            hidden,
            weight,
            bias: None,
        } => Some((hidden, weight)),
        _ => None,
    }
}

/// Whether `expr` is a head the rewriter marked (`SplitHead(…)`, `SplitHead::of(…)`,
/// `tied_head(…)` of `tchmem::fused_loss`), past a `&`.
fn is_marked(expr: &Expr) -> bool {
    let Expr::Call(call) = unreferenced(expr) else {
        return false;
    };
    let Expr::Path(func) = &*call.func else {
        return false;
    };
    let names = segments(&func.path);
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    matches!(
        names.as_slice(),
        ["tchmem", "fused_loss", "SplitHead"]
            | ["tchmem", "fused_loss", "SplitHead", "of"]
            | ["tchmem", "fused_loss", "tied_head"]
    )
}

/// An expression's text on one line, a method chain by its last call (`….add_fn(…)`).
fn expr_text(expr: &Expr) -> String {
    let (prefix, shown) = match strip_parens(expr) {
        Expr::MethodCall(call) => {
            let mut last = call.clone();
            *last.receiver = syn::parse_quote!(x);
            ("…", Expr::MethodCall(last))
        }
        other => ("", other.clone()),
    };
    let text = pretty(&Stmt::Expr(shown, None));
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let text = text
        .strip_prefix("x.")
        .map_or(text.clone(), |rest| format!(".{rest}"));
    format!("{prefix}{text}")
}
