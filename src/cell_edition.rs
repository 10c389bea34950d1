//! Cells written for edition 2021 in evcxr's cell crate, which is edition 2024 (its own code in
//! every cell needs 2024: let chains).
//!
//! The difference tch code meets is how `impl Trait` in a return type captures lifetimes: 2021
//! captures the generic type and const parameters and only the lifetimes the bounds name; 2024
//! captures every lifetime in scope. tch-rs's `fn block(p: &nn::Path, ..) -> impl ModuleT` then
//! keeps `p` borrowed as long as the block lives, and the cell fails to borrow-check ("temporary
//! value dropped while borrowed"). Precise capturing says the 2021 rule out loud: each such
//! `impl Trait` gets `+ use<..>` with the parameters 2021 would capture, appended at the end of
//! its line, so the cell keeps its line numbers.
//!
//! Left as 2024 (where the rule cannot be written out): bounds that mention an elided lifetime
//! (`impl Iterator<Item = &u8>`; inside `Fn(&T)` sugar lifetimes are the closure's own, which is
//! fine), functions with `impl Trait` arguments (their hidden type parameters cannot be named),
//! `async fn` and trait methods (which capture everything in both editions). A bound with a path
//! whose lifetime is hidden (`Item = Ref<T>`) cannot be told from syntax; such a cell fails as it
//! would have before, and `:edition 2024` turns the rewrite off.

use std::collections::BTreeSet;

use proc_macro2::TokenTree;
use quote::ToTokens;
use syn::visit::Visit;
use syn::{GenericParam, Generics, ReturnType, Signature, TypeImplTrait, TypeParamBound};

use crate::cell_syntax;

/// The cell with `+ use<..>` added where 2021 capture rules must be said, or `None` when nothing
/// changes (or the cell does not parse).
pub fn as_2021(cell: &str) -> Option<String> {
    let insertions = cell_syntax::with_parsed_block(cell, |block| {
        let mut finder = Finder::default();
        for stmt in &block.stmts {
            finder.visit_stmt(stmt);
        }
        finder.insertions
    })?;
    if insertions.is_empty() {
        return None;
    }
    let mut lines: Vec<String> = cell.split('\n').map(str::to_string).collect();
    // Right to left on a line, so that earlier columns stay valid.
    let mut sorted = insertions;
    sorted.sort_by_key(|i| std::cmp::Reverse((i.line, i.column)));
    for insertion in sorted {
        let line = lines.get_mut(insertion.line)?;
        let byte = line
            .char_indices()
            .nth(insertion.column)
            .map_or(line.len(), |(i, _)| i);
        line.insert_str(byte, &insertion.text);
    }
    Some(lines.join("\n"))
}

/// Text to insert at a cell position (0-based line, column in characters).
#[derive(Debug)]
struct Insertion {
    line: usize,
    column: usize,
    text: String,
}

#[derive(Default)]
struct Finder {
    insertions: Vec<Insertion>,
}

impl Finder {
    /// Says the 2021 rule for the `impl Trait`s in `sig`'s return type, with `outer` the
    /// parameters of an enclosing inherent impl.
    fn signature(&mut self, sig: &Signature, outer: Option<&Generics>) {
        let ReturnType::Type(_, ty) = &sig.output else {
            return;
        };
        if sig.asyncness.is_some() || has_impl_trait_argument(sig) {
            return;
        }
        let params: Vec<&GenericParam> = outer
            .into_iter()
            .flat_map(|g| g.params.iter())
            .chain(sig.generics.params.iter())
            .collect();
        let mut impls = ImplTraits::default();
        impls.visit_type(ty);
        for found in impls.found {
            if let Some(insertion) = capture(found, &params) {
                self.insertions.push(insertion);
            }
        }
    }
}

impl<'ast> Visit<'ast> for Finder {
    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        self.signature(&item.sig, None);
        syn::visit::visit_block(self, &item.block);
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        for impl_item in &item.items {
            if let syn::ImplItem::Fn(function) = impl_item {
                // Methods of a trait impl capture everything in both editions.
                if item.trait_.is_none() {
                    self.signature(&function.sig, Some(&item.generics));
                }
                syn::visit::visit_block(self, &function.block);
            }
        }
    }

    fn visit_item_trait(&mut self, item: &'ast syn::ItemTrait) {
        for trait_item in &item.items {
            if let syn::TraitItem::Fn(syn::TraitItemFn {
                default: Some(block),
                ..
            }) = trait_item
            {
                syn::visit::visit_block(self, block);
            }
        }
    }
}

/// The `impl Trait`s of a return type.
#[derive(Default)]
struct ImplTraits<'ast> {
    found: Vec<&'ast TypeImplTrait>,
}

impl<'ast> Visit<'ast> for ImplTraits<'ast> {
    fn visit_type_impl_trait(&mut self, it: &'ast TypeImplTrait) {
        self.found.push(it);
    }
}

/// The `+ use<..>` for one `impl Trait`, or `None` where the rule cannot be written out.
fn capture(it: &TypeImplTrait, params: &[&GenericParam]) -> Option<Insertion> {
    if it
        .bounds
        .iter()
        .any(|bound| matches!(bound, TypeParamBound::PreciseCapture(_)))
        || mentions_elided_lifetime(it)
    {
        return None;
    }
    let named = lifetimes_in(it.bounds.to_token_stream());
    let mut captured: Vec<String> = params
        .iter()
        .filter_map(|param| match param {
            GenericParam::Lifetime(l) => {
                let name = l.lifetime.ident.to_string();
                named.contains(&name).then(|| format!("'{name}"))
            }
            _ => None,
        })
        .collect();
    captured.extend(params.iter().filter_map(|param| match param {
        GenericParam::Type(t) => Some(t.ident.to_string()),
        GenericParam::Const(c) => Some(c.ident.to_string()),
        GenericParam::Lifetime(_) => None,
    }));
    let end = it
        .bounds
        .last()?
        .to_token_stream()
        .into_iter()
        .last()?
        .span()
        .end();
    // The parsed text starts with a line `{` (see cell_syntax::with_parsed_block).
    Some(Insertion {
        line: end.line.checked_sub(2)?,
        column: end.column,
        text: format!(" + use<{}>", captured.join(", ")),
    })
}

/// Whether the bounds name a lifetime by elision: `&T` or `'_`, outside `Fn(..)` sugar (whose
/// elided lifetimes belong to the closure's signature).
fn mentions_elided_lifetime(it: &TypeImplTrait) -> bool {
    struct Elided(bool);
    impl<'ast> Visit<'ast> for Elided {
        fn visit_type_reference(&mut self, reference: &'ast syn::TypeReference) {
            self.0 |= reference.lifetime.is_none();
            syn::visit::visit_type_reference(self, reference);
        }
        fn visit_lifetime(&mut self, lifetime: &'ast syn::Lifetime) {
            self.0 |= lifetime.ident == "_";
        }
        fn visit_parenthesized_generic_arguments(
            &mut self,
            _: &'ast syn::ParenthesizedGenericArguments,
        ) {
        }
    }
    let mut elided = Elided(false);
    for bound in &it.bounds {
        elided.visit_type_param_bound(bound);
    }
    elided.0
}

/// The lifetime names (without `'`) in a token stream.
fn lifetimes_in(tokens: proc_macro2::TokenStream) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut apostrophe = false;
    for token in tokens {
        match token {
            TokenTree::Punct(p) if p.as_char() == '\'' => {
                apostrophe = true;
                continue;
            }
            TokenTree::Ident(ident) if apostrophe => {
                names.insert(ident.to_string());
            }
            TokenTree::Group(group) => names.extend(lifetimes_in(group.stream())),
            _ => {}
        }
        apostrophe = false;
    }
    names
}

/// Whether an argument's type holds `impl Trait` (an anonymous type parameter).
fn has_impl_trait_argument(sig: &Signature) -> bool {
    let mut impls = ImplTraits::default();
    for input in &sig.inputs {
        if let syn::FnArg::Typed(typed) = input {
            impls.visit_type(&typed.ty);
        }
    }
    !impls.found.is_empty()
}

#[cfg(test)]
mod tests {
    use super::as_2021;

    #[test]
    fn return_position_impl_trait_captures_what_2021_captures() {
        let cell = "use tch::nn;\n\
                    fn block(p: &nn::Path, dim: i64) -> impl nn::ModuleT {\n    \
                    nn::func_t(|xs, _| xs.shallow_clone())\n}";
        assert_eq!(
            as_2021(cell).unwrap(),
            "use tch::nn;\n\
             fn block(p: &nn::Path, dim: i64) -> impl nn::ModuleT + use<> {\n    \
             nn::func_t(|xs, _| xs.shallow_clone())\n}"
        );
        assert_eq!(
            as_2021("fn f<'a, 'b, T: Clone, const N: usize>(x: &'a T, y: &'b u8) -> impl Iterator<Item = &'a T> + Clone { todo!() }").unwrap(),
            "fn f<'a, 'b, T: Clone, const N: usize>(x: &'a T, y: &'b u8) -> impl Iterator<Item = &'a T> + Clone + use<'a, T, N> { todo!() }"
        );
        assert_eq!(
            as_2021("fn adder(k: &i64) -> impl Fn(&i64) -> i64 { let k = *k; move |x| x + k }")
                .unwrap(),
            "fn adder(k: &i64) -> impl Fn(&i64) -> i64 + use<> { let k = *k; move |x| x + k }",
            "Fn sugar's elided lifetimes are the closure's own"
        );
    }

    #[test]
    fn inherent_methods_capture_the_impl_parameters_and_nested_items_are_found() {
        let cell = "struct S<T>(Vec<T>);\nimpl<T: Clone> S<T> {\n    \
                    fn items(&self) -> Box<impl Fn() -> Vec<T>> { todo!() }\n}\n\
                    let f = {\n    fn inner(x: &str) -> impl std::fmt::Debug { x.len() }\n    \
                    inner(\"ab\")\n};";
        let out = as_2021(cell).unwrap();
        assert!(out.contains("Box<impl Fn() -> Vec<T> + use<T>>"), "{out}");
        assert!(out.contains("-> impl std::fmt::Debug + use<> {"), "{out}");
        assert_eq!(out.lines().count(), cell.lines().count());
    }

    #[test]
    fn what_cannot_be_said_is_left_as_it_is() {
        for cell in [
            "fn f(x: &[u8]) -> impl Iterator<Item = &u8> { x.iter() }",
            "fn f(x: &[u8]) -> impl Iterator<Item = u8> + '_ { x.iter().copied() }",
            "fn f(x: impl Clone) -> impl Clone { x }",
            "async fn f(x: &u8) -> u8 { *x }",
            "trait T { fn f(&self) -> impl Clone; }",
            "impl Iterator for S { type Item = u8; fn next(&mut self) -> Option<u8> { None } }",
            "fn f(x: &u8) -> impl Clone + use<> { 1 }",
            "fn f() -> u8 { 1 }",
            "let x = 1;",
            "fn broken(",
        ] {
            assert_eq!(as_2021(cell), None, "{cell}");
        }
    }

    #[test]
    fn insertions_land_after_non_ascii_text_and_keep_leading_commands() {
        let cell = ":dep foo\n// 张量\nfn f(p: &str) -> impl Clone /* 块 */ { p.len() }";
        assert_eq!(
            as_2021(cell).unwrap(),
            ":dep foo\n// 张量\nfn f(p: &str) -> impl Clone + use<> /* 块 */ { p.len() }"
        );
    }
}
