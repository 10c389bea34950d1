//! Mixed precision: the forward pass and loss run inside `tchmem::amp::autocast`, and for f16
//! a `tchmem::amp::GradScaler` scales the loss and steps the optimizer.

use proc_macro2::{Ident, TokenStream};
use quote::quote;
use syn::{Expr, Stmt};

use super::earlier::EarlierFn;
use super::syntax::{stmts, Binding};
use super::{Amp, Refusal};

/// Ops libtorch refuses under autocast (`autocast_mode.cpp`'s banned list): their f16/bf16
/// results are unsafe, and the call fails at run time.
const REFUSED_UNDER_AUTOCAST: [&str; 1] = ["binary_cross_entropy"];

/// An op of [`REFUSED_UNDER_AUTOCAST`] that `span` (the statements autocast would wrap) calls,
/// itself or in a function of an earlier cell that it calls: the op, and where (`None`: in the
/// span).
pub(crate) fn refused_op<'f>(
    span: &[Stmt],
    functions: &'f [EarlierFn],
) -> Option<(&'static str, Option<&'f EarlierFn>)> {
    let refused = |tokens: TokenStream| {
        let names = super::earlier::identifiers(tokens);
        let op = REFUSED_UNDER_AUTOCAST
            .into_iter()
            .find(|op| names.contains(*op));
        (op, names)
    };
    let (op, mut names) = refused(quote!(#(#span)*));
    if let Some(op) = op {
        return Some((op, None));
    }
    let mut seen: Vec<&str> = Vec::new();
    while let Some(function) = functions
        .iter()
        .find(|f| names.contains(&f.name) && !seen.contains(&f.name.as_str()))
    {
        seen.push(&function.name);
        let tokens: TokenStream = function.code.parse().unwrap_or_default();
        let (op, more) = refused(tokens);
        if let Some(op) = op {
            return Some((op, Some(function)));
        }
        names.extend(more);
    }
    None
}

/// `tch::Kind::…` for an AMP kind.
pub(crate) fn kind(amp: Amp) -> TokenStream {
    match amp {
        Amp::Bf16 => quote!(tch::Kind::BFloat16),
        Amp::F16 => quote!(tch::Kind::Half),
    }
}

/// `let (a, b, loss) = tchmem::amp::autocast_on((&vs).device(), kind, || { body; (a, b, loss) });`
/// (or `autocast(kind, …)`, CUDA when available, without a VarStore): `body` runs under
/// autocast on the model's device and the variables in `returned` stay available after it.
pub(crate) fn autocast(
    amp: Amp,
    var_store: Option<&Expr>,
    body: &[Stmt],
    returned: &[Binding],
) -> Result<Stmt, Refusal> {
    let kind = kind(amp);
    let names: Vec<&Ident> = returned.iter().map(|b| &b.ident).collect();
    let patterns: Vec<TokenStream> = returned
        .iter()
        .map(|b| {
            let ident = &b.ident;
            if b.mutable {
                quote!(mut #ident)
            } else {
                quote!(#ident)
            }
        })
        .collect();
    let (pattern, value) = match (patterns.as_slice(), names.as_slice()) {
        ([pattern], [name]) => (pattern.clone(), quote!(#name)),
        _ => (quote!((#(#patterns),*)), quote!((#(#names),*))),
    };
    let call = match var_store {
        Some(vs) => quote!(tchmem::amp::autocast_on((#vs).device(), #kind, || {
            #(#body)*
            #value
        })),
        None => quote!(tchmem::amp::autocast(#kind, || {
            #(#body)*
            #value
        })),
    };
    let generated = stmts(quote! {
        let #pattern = #call;
    })?;
    generated
        .into_iter()
        .next()
        .ok_or_else(|| Refusal::new("internal error: no autocast statement", None))
}

/// `let mut grad_scaler = tchmem::amp::GradScaler::new(vs);`.
pub(crate) fn scaler(name: &Ident, vs: &Expr) -> Result<Vec<Stmt>, Refusal> {
    stmts(quote! {
        let mut #name = tchmem::amp::GradScaler::new(#vs);
    })
}
