//! Small syntax helpers shared by the rewrites: names, paths, patterns, token searches.

use std::collections::BTreeSet;

use proc_macro2::{Ident, Span, TokenStream, TokenTree};
use quote::ToTokens;
use syn::{Block, Expr, Pat, Stmt};

use super::Refusal;

/// The name of the macro that marks a comment to print (prettyplease prints no comments).
pub(crate) const COMMENT_MACRO: &str = "__tchmem_comment";

/// Every identifier in a cell, to pick names for generated variables that cannot collide.
pub(crate) struct Names {
    taken: BTreeSet<String>,
}

impl Names {
    /// The identifiers of `block`, macro arguments included.
    pub fn of(block: &Block) -> Names {
        let mut taken = BTreeSet::new();
        walk_tokens(block.to_token_stream(), &mut |tree| match tree {
            TokenTree::Ident(ident) => {
                taken.insert(ident.to_string());
            }
            TokenTree::Literal(literal) => {
                // Names captured by format strings (`{loss}`) are names in use too.
                let text = literal.to_string();
                for word in text.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
                    if !word.is_empty() {
                        taken.insert(word.to_string());
                    }
                }
            }
            _ => {}
        });
        Names { taken }
    }

    /// `base` if the cell does not use it, else `tchmem_base` (or `tchmem_base_2`, …).
    pub fn fresh(&mut self, base: &str) -> Ident {
        let mut name = base.to_string();
        let mut n = 1;
        while self.taken.contains(&name) {
            name = match n {
                1 => format!("tchmem_{base}"),
                _ => format!("tchmem_{base}_{n}"),
            };
            n += 1;
        }
        self.taken.insert(name.clone());
        Ident::new(&name, Span::call_site())
    }
}

/// Calls `f` on every token of `tokens`, inside groups too.
pub(crate) fn walk_tokens(tokens: TokenStream, f: &mut impl FnMut(&TokenTree)) {
    for tree in tokens {
        f(&tree);
        if let TokenTree::Group(group) = &tree {
            walk_tokens(group.stream(), f);
        }
    }
}

/// The `tchmem::MODULE` paths the cell already uses (`checkpoint`, `amp`, …), so that a
/// rewrite is not applied twice.
pub(crate) fn tchmem_modules(block: &Block) -> BTreeSet<String> {
    let mut modules = BTreeSet::new();
    collect_tchmem_modules(block.to_token_stream(), &mut modules);
    modules
}

fn collect_tchmem_modules(tokens: TokenStream, modules: &mut BTreeSet<String>) {
    let trees: Vec<TokenTree> = tokens.into_iter().collect();
    for (i, tree) in trees.iter().enumerate() {
        match tree {
            TokenTree::Ident(ident) if ident == "tchmem" => {
                let colons = trees.get(i + 1..i + 3).is_some_and(|pair| {
                    pair.iter()
                        .all(|t| matches!(t, TokenTree::Punct(p) if p.as_char() == ':'))
                });
                if let (true, Some(TokenTree::Ident(module))) = (colons, trees.get(i + 3)) {
                    modules.insert(module.to_string());
                }
            }
            TokenTree::Group(group) => collect_tchmem_modules(group.stream(), modules),
            _ => {}
        }
    }
}

/// Whether `tokens` use the variable `name`: as an identifier, or captured by a format string.
pub(crate) fn mentions(tokens: TokenStream, name: &str) -> bool {
    let captured = [format!("{{{name}}}"), format!("{{{name}:")];
    let mut found = false;
    walk_tokens(tokens, &mut |tree| match tree {
        TokenTree::Ident(ident) if ident == name => found = true,
        TokenTree::Literal(literal) => {
            let text = literal.to_string();
            if captured.iter().any(|c| text.contains(c.as_str())) {
                found = true;
            }
        }
        _ => {}
    });
    found
}

/// Whether any of `stmts` uses the variable `name`.
pub(crate) fn stmts_mention(stmts: &[Stmt], name: &str) -> bool {
    stmts
        .iter()
        .any(|stmt| mentions(stmt.to_token_stream(), name))
}

/// A path's segment names.
pub(crate) fn segments(path: &syn::Path) -> Vec<String> {
    path.segments.iter().map(|s| s.ident.to_string()).collect()
}

/// Whether a path ends with `suffix` and what comes before is a tch `nn` path (`nn::X`,
/// `tch::nn::X`, `::tch::nn::X`).
pub(crate) fn is_nn_path(path: &syn::Path, suffix: &[&str]) -> bool {
    let names = segments(path);
    let Some(prefix_len) = names.len().checked_sub(suffix.len()) else {
        return false;
    };
    let (prefix, rest) = names.split_at(prefix_len);
    rest == suffix
        && matches!(
            prefix.iter().map(String::as_str).collect::<Vec<_>>()[..],
            ["nn"] | ["tch", "nn"]
        )
}

/// The name a simple pattern binds (`batch`, `mut opt`, `opt: nn::Optimizer`).
pub(crate) fn single_name(pat: &Pat) -> Option<String> {
    match pat {
        Pat::Ident(ident) => Some(ident.ident.to_string()),
        Pat::Type(typed) => single_name(&typed.pat),
        _ => None,
    }
}

/// The identifier of a plain variable expression (`x`).
pub(crate) fn as_ident(expr: &Expr) -> Option<&Ident> {
    match strip_parens(expr) {
        Expr::Path(p) if p.qself.is_none() => p.path.get_ident(),
        _ => None,
    }
}

/// The variable of `x` or `&x`.
pub(crate) fn as_ref_ident(expr: &Expr) -> Option<&Ident> {
    match strip_parens(expr) {
        Expr::Reference(r) if r.mutability.is_none() => as_ident(&r.expr),
        other => as_ident(other),
    }
}

/// The variable of `&mut x`.
pub(crate) fn as_mut_ref_ident(expr: &Expr) -> Option<&Ident> {
    match strip_parens(expr) {
        Expr::Reference(r) if r.mutability.is_some() => as_ident(&r.expr),
        _ => None,
    }
}

/// `expr` past a `&` (`head` of `&head`), without enclosing parentheses.
pub(crate) fn unreferenced(expr: &Expr) -> &Expr {
    match strip_parens(expr) {
        Expr::Reference(r) => strip_parens(&r.expr),
        other => other,
    }
}

/// `expr` without enclosing parentheses.
pub(crate) fn strip_parens(mut expr: &Expr) -> &Expr {
    while let Expr::Paren(p) = expr {
        expr = &p.expr;
    }
    expr
}

/// The call `expr` makes past `?`, parentheses and the methods `unwraps` that take its value
/// out (`make(…)?`, `(make(…)).unwrap()`), when it is one.
pub(crate) fn call_under<'a>(mut expr: &'a Expr, unwraps: &[&str]) -> Option<&'a syn::ExprCall> {
    loop {
        expr = match expr {
            Expr::Try(inner) => &inner.expr,
            Expr::Paren(inner) => &inner.expr,
            Expr::MethodCall(call) if unwraps.iter().any(|method| call.method == method) => {
                &call.receiver
            }
            Expr::Call(call) => return Some(call),
            _ => return None,
        };
    }
}

/// A variable bound by a pattern.
#[derive(Debug, Clone)]
pub(crate) struct Binding {
    pub ident: Ident,
    pub mutable: bool,
    pub by_ref: bool,
}

/// The variables a pattern binds, in order.
pub(crate) fn bindings(pat: &Pat) -> Vec<Binding> {
    let mut out = Vec::new();
    collect_bindings(pat, &mut out);
    out
}

fn collect_bindings(pat: &Pat, out: &mut Vec<Binding>) {
    match pat {
        Pat::Ident(p) => {
            // An upper-case name is a constant or unit struct being matched, not a binding.
            let name = p.ident.to_string();
            if !name.starts_with(|c: char| c.is_uppercase()) && name != "_" {
                out.push(Binding {
                    ident: p.ident.clone(),
                    mutable: p.mutability.is_some(),
                    by_ref: p.by_ref.is_some(),
                });
            }
            if let Some((_, sub)) = &p.subpat {
                collect_bindings(sub, out);
            }
        }
        Pat::Tuple(t) => t.elems.iter().for_each(|p| collect_bindings(p, out)),
        Pat::TupleStruct(t) => t.elems.iter().for_each(|p| collect_bindings(p, out)),
        Pat::Struct(s) => s.fields.iter().for_each(|f| collect_bindings(&f.pat, out)),
        Pat::Slice(s) => s.elems.iter().for_each(|p| collect_bindings(p, out)),
        Pat::Reference(r) => collect_bindings(&r.pat, out),
        Pat::Type(t) => collect_bindings(&t.pat, out),
        Pat::Paren(p) => collect_bindings(&p.pat, out),
        // Every alternative binds the same names.
        Pat::Or(o) => {
            if let Some(first) = o.cases.first() {
                collect_bindings(first, out);
            }
        }
        _ => {}
    }
}

/// The variables a `let` statement binds.
pub(crate) fn let_bindings(stmt: &Stmt) -> Vec<Binding> {
    match stmt {
        Stmt::Local(local) => bindings(&local.pat),
        _ => Vec::new(),
    }
}

/// Whether the `let` statement `stmt` binds `name`.
pub(crate) fn binds(stmt: &Stmt, name: &Ident) -> bool {
    let_bindings(stmt).iter().any(|b| b.ident == *name)
}

/// A statement that prints as the comment `// text`.
pub(crate) fn comment(text: &str) -> Stmt {
    let name = Ident::new(COMMENT_MACRO, Span::call_site());
    syn::parse_quote!(#name!(#text);)
}

/// Parses generated tokens as statements (the rewrites build them with `quote!`).
pub(crate) fn stmts(tokens: TokenStream) -> Result<Vec<Stmt>, Refusal> {
    // Generated code always parses (the tests hold every output to that); an error is a bug.
    syn::parse2::<Block>(quote::quote!({ #tokens }))
        .map(|block| block.stmts)
        .map_err(|error| {
            Refusal::new(
                format!(
                    "internal error: the rewritten code did not parse ({error}); please report \
                     it with the cell"
                ),
                None,
            )
        })
}
