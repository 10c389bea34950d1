//! A library module's source made an item of a trial's code (`mod __tchmem_resnet { … }`): only
//! what the called function reaches, its paths written from outside the library.

use std::collections::HashSet;

use proc_macro2::{Ident, Span};
use quote::ToTokens;
use syn::visit_mut::{self, VisitMut};
use syn::{Item, UseTree, Visibility};

use super::definitions::names_in;

/// The items of `source`, the module `module` (`["tch", "vision", "resnet"]`), that `function`
/// reaches (what it calls, the types and macros it names, their impls) and the `use` lines they
/// need; its paths from the crate's root written from the crate (`crate::nn` → `tch::nn`),
/// those to its parents written whole (`super::x` → `tch::vision::x`), restricted visibilities
/// and `function` made public (inside the private module [`as_module`] puts them in). `None`
/// where the source does not parse or holds no `function`.
pub(super) fn reached_items(module: &[String], source: &str, function: &str) -> Option<Vec<Item>> {
    let mut file = syn::parse_file(source).ok()?;
    Outside { module, depth: 0 }.visit_file_mut(&mut file);
    let krate = module.first()?;
    let mut items = reached_from(function, krate, file.items)?;
    for item in &mut items {
        if let Item::Fn(f) = item {
            if f.sig.ident == function {
                f.vis = syn::parse_quote!(pub);
            }
        }
    }
    Some(items)
}

/// `items` as an item of the trial's code: `mod NAME { … }`.
pub(super) fn as_module(name: &str, items: Vec<Item>) -> String {
    let body = prettyplease::unparse(&syn::File {
        shebang: None,
        attrs: Vec::new(),
        items,
    });
    // A type or trait of the crate kept for its methods may be used nowhere here.
    format!("#[allow(unused_imports)]\nmod {name} {{\n{body}}}")
}

/// Writes the module's paths as code outside its crate sees them.
struct Outside<'a> {
    module: &'a [String],
    /// How deep in the file's own inline modules the visit is (their `super`s up to this
    /// depth stay inside the file).
    depth: usize,
}

impl Outside<'_> {
    /// The path that `supers` leading `super`s (none: `crate`) stand for; `None` where they
    /// stay inside the file or climb past the crate.
    fn root(&self, supers: usize) -> Option<Vec<Ident>> {
        let keep = if supers == 0 {
            1
        } else {
            let beyond = supers.checked_sub(self.depth).filter(|&n| n > 0)?;
            self.module.len().checked_sub(beyond)?
        };
        (keep >= 1).then(|| {
            self.module[..keep]
                .iter()
                .map(|s| Ident::new(s, Span::call_site()))
                .collect()
        })
    }
}

impl VisitMut for Outside<'_> {
    fn visit_path_mut(&mut self, path: &mut syn::Path) {
        let leading = |name: &str| path.segments.iter().take_while(|s| s.ident == name).count();
        let (crates, supers) = (leading("crate").min(1), leading("super"));
        if crates + supers > 0 {
            if let Some(root) = self.root(supers) {
                let rest: Vec<syn::PathSegment> = path
                    .segments
                    .iter()
                    .skip(crates + supers)
                    .cloned()
                    .collect();
                path.segments = root.into_iter().map(syn::PathSegment::from).collect();
                path.segments.extend(rest);
            }
        }
        visit_mut::visit_path_mut(self, path);
    }

    fn visit_item_use_mut(&mut self, item: &mut syn::ItemUse) {
        self.visit_visibility_mut(&mut item.vis);
        let mut supers = 0;
        let mut tree = &item.tree;
        let mut crate_root = false;
        while let UseTree::Path(path) = tree {
            if path.ident == "super" {
                supers += 1;
            } else {
                crate_root = supers == 0 && path.ident == "crate";
                break;
            }
            tree = &path.tree;
        }
        let skip = supers + crate_root as usize;
        if skip == 0 {
            return;
        }
        let Some(root) = self.root(supers) else {
            return;
        };
        let mut rest = item.tree.clone();
        for _ in 0..skip {
            if let UseTree::Path(path) = rest {
                rest = *path.tree;
            }
        }
        item.tree = root.into_iter().rev().fold(rest, |tree, ident| {
            UseTree::Path(syn::UsePath {
                ident,
                colon2_token: Default::default(),
                tree: Box::new(tree),
            })
        });
    }

    fn visit_item_mod_mut(&mut self, item: &mut syn::ItemMod) {
        self.depth += 1;
        visit_mut::visit_item_mod_mut(self, item);
        self.depth -= 1;
    }

    fn visit_visibility_mut(&mut self, vis: &mut Visibility) {
        // `pub(crate)`, `pub(in crate::x)`: the crate is not this one any more. Public inside
        // the private module around them, so nested modules still reach each other.
        if matches!(vis, Visibility::Restricted(_)) {
            *vis = syn::parse_quote!(pub);
        }
    }
}

/// What an item defines, by name (an impl: the type it is for).
fn name_of(item: &Item) -> Option<String> {
    Some(match item {
        Item::Fn(f) => f.sig.ident.to_string(),
        Item::Struct(s) => s.ident.to_string(),
        Item::Enum(e) => e.ident.to_string(),
        Item::Union(u) => u.ident.to_string(),
        Item::Const(c) => c.ident.to_string(),
        Item::Static(s) => s.ident.to_string(),
        Item::Type(t) => t.ident.to_string(),
        Item::Trait(t) => t.ident.to_string(),
        Item::Mod(m) if m.content.is_some() => m.ident.to_string(),
        Item::Macro(m) => m.ident.as_ref()?.to_string(),
        Item::Impl(i) => type_name(&i.self_ty)?,
        _ => return None,
    })
}

/// The last name of a type's path (`Net` of `&Net` and `crate::Net`).
fn type_name(ty: &syn::Type) -> Option<String> {
    match ty {
        syn::Type::Path(p) => Some(p.path.segments.last()?.ident.to_string()),
        syn::Type::Reference(r) => type_name(&r.elem),
        _ => None,
    }
}

/// The items `function` reaches through the names their code holds, and the `use` lines they
/// need, in the file's order; `None` without `function`. An impl goes with its type where the
/// file may write it (its type or its trait defined in the file); a `use` line stays where it
/// brings in a name the kept items hold, or a type, trait or glob of `krate` (the library's own
/// crate) or of std (a trait in scope for its methods is named nowhere).
fn reached_from(function: &str, krate: &str, items: Vec<Item>) -> Option<Vec<Item>> {
    let defined: HashSet<String> = items
        .iter()
        .filter(|item| !matches!(item, Item::Impl(_)))
        .filter_map(name_of)
        .collect();
    let writable = |item: &Item| match item {
        Item::Impl(i) => {
            let own_trait = i.trait_.as_ref().is_some_and(|(_, path, _)| {
                path.segments
                    .last()
                    .is_some_and(|s| defined.contains(&s.ident.to_string()))
            });
            own_trait || type_name(&i.self_ty).is_some_and(|t| defined.contains(&t))
        }
        _ => true,
    };
    let mut kept = vec![false; items.len()];
    let mut names: HashSet<String> = HashSet::new();
    let mut todo = vec![function.to_string()];
    while let Some(next) = todo.pop() {
        if !names.insert(next.clone()) {
            continue;
        }
        for (i, item) in items.iter().enumerate() {
            if !kept[i] && name_of(item).as_deref() == Some(next.as_str()) && writable(item) {
                kept[i] = true;
                todo.extend(names_in(item.to_token_stream()));
            }
        }
    }
    let found = items
        .iter()
        .zip(&kept)
        .any(|(item, kept)| *kept && matches!(item, Item::Fn(f) if f.sig.ident == function));
    if !found {
        return None;
    }
    let needed = |item: &Item| match item {
        Item::Use(u) => imported(&u.tree).iter().any(|(root, name)| {
            let ours = root
                .as_deref()
                .is_some_and(|r| ["std", "core", "alloc", krate].contains(&r));
            names.contains(name) || (ours && (name == "*" || name.starts_with(char::is_uppercase)))
        }),
        _ => false,
    };
    let keep: Vec<bool> = items
        .iter()
        .zip(&kept)
        .map(|(item, kept)| *kept || needed(item))
        .collect();
    Some(
        items
            .into_iter()
            .zip(keep)
            .filter(|(_, keep)| *keep)
            .map(|(item, _)| item)
            .collect(),
    )
}

/// The names a `use` tree brings in, each with the tree's first segment.
fn imported(tree: &UseTree) -> Vec<(Option<String>, String)> {
    /// `root`: the tree's first segment; `last`: the segment before this subtree.
    fn walk(
        tree: &UseTree,
        root: Option<&str>,
        last: Option<&str>,
        out: &mut Vec<(Option<String>, String)>,
    ) {
        let name = |n: &str| (root.map(str::to_string), n.to_string());
        match tree {
            UseTree::Path(p) => {
                let ident = p.ident.to_string();
                walk(&p.tree, root.or(Some(&ident)), Some(&ident), out);
            }
            // `nn::{self}` brings in `nn`.
            UseTree::Name(n) if n.ident == "self" => out.extend(last.map(name)),
            UseTree::Name(n) => out.push(name(&n.ident.to_string())),
            UseTree::Rename(r) => out.push(name(&r.rename.to_string())),
            UseTree::Group(g) => g.items.iter().for_each(|t| walk(t, root, last, out)),
            UseTree::Glob(_) => out.push(name("*")),
        }
    }
    let mut out = Vec::new();
    walk(tree, None, None, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The module's reached items as the trial's item.
    fn as_item(name: &str, module: &[String], source: &str, function: &str) -> Option<String> {
        reached_items(module, source, function).map(|items| as_module(name, items))
    }

    fn path(text: &str) -> Vec<String> {
        text.split("::").map(str::to_string).collect()
    }

    const SOURCE: &str = "//! A model.\n\
        use crate::{nn, nn::FuncT, nn::Module};\n\
        use super::super::Kind;\n\
        use super::dataset::Dataset;\n\
        use rand::Rng;\n\
        macro_rules! width { () => { 3 } }\n\
        pub(crate) struct Shape(i64);\n\
        impl Shape { pub(in crate::vision) fn get(&self) -> i64 { self.0 } }\n\
        impl crate::Tensor { fn swish(&self) -> Self { todo!() } }\n\
        fn size() -> Shape { Shape(width!()) }\n\
        fn unused() -> i64 { super::helper() }\n\
        /// The model.\n\
        pub(crate) fn f(p: &nn::Path) -> FuncT<'static> { let _ = (size().get(), super::helper(), Kind::Float); todo!() }\n";

    #[test]
    fn the_item_holds_what_the_function_reaches_written_from_outside_the_crate() {
        let item = as_item("__tchmem_m", &path("tch::vision::m"), SOURCE, "f").unwrap();
        syn::parse_str::<syn::Item>(&item).unwrap();
        let has = |text: &str| item.contains(text);
        assert!(has("mod __tchmem_m {"), "{item}");
        // Reached: the function, the type it names with its impl, the macro; made public.
        for reached in [
            "pub fn f(",
            "struct Shape",
            "impl Shape",
            "fn size",
            "macro_rules! width",
            "/// The model.",
        ] {
            assert!(has(reached), "{reached}: {item}");
        }
        // Paths from the crate's root and the parents', in `use` lines and in code.
        assert!(has("use tch::{nn, nn::FuncT, nn::Module};"), "{item}");
        assert!(has("use tch::Kind;"), "{item}");
        assert!(has("tch::vision::helper()"), "{item}");
        // Restricted visibilities are the old crate's.
        assert!(!has("pub(crate)") && !has("pub(in"), "{item}");
        // A type of the crate stays imported (it may be a trait whose methods the code calls).
        assert!(has("use tch::vision::dataset::Dataset;"), "{item}");
        // Not reached, or not writable outside the crate (an inherent impl of tch's Tensor), or
        // an import of a crate the notebook may lack that nothing kept names.
        for left in ["fn unused", "swish", "rand::Rng", "//!"] {
            assert!(!has(left), "{left}: {item}");
        }
        assert_eq!(as_item("m", &path("tch::x"), "fn (", "f"), None);
        assert_eq!(as_item("m", &path("tch::x"), SOURCE, "g"), None);
    }

    #[test]
    fn the_files_own_modules_keep_their_supers_and_reach_each_other() {
        let source = "use crate::nn::{self};\n\
            mod inner { use super::Shape; pub(crate) fn make() -> Shape { Shape(super::super::W) } }\n\
            pub(super) struct Shape(i64);\n\
            pub fn f() -> i64 { let s = inner::make(); let _ = nn::Path::default; s.0 }\n";
        let item = as_item("__tchmem_m", &path("tch::vision::m"), source, "f").unwrap();
        syn::parse_str::<syn::Item>(&item).unwrap();
        // Inside `inner`, one `super` is the file; two are the file's parent.
        assert!(item.contains("use super::Shape;"), "{item}");
        assert!(item.contains("Shape(tch::vision::W)"), "{item}");
        // Restricted visibilities become public inside the private module around them.
        assert!(
            item.contains("pub fn make()") && item.contains("pub struct Shape"),
            "{item}"
        );
        // `nn::{self}` imports `nn`, which the function names.
        assert!(item.contains("use tch::nn::{self};"), "{item}");
    }
}
