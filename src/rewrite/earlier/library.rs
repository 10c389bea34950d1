//! Models built by a library's function (`resnet::resnet18(&vs.root(), 10)` from `tch::vision`):
//! the function's module, read from the dependency's own sources, goes in front of the cell as a
//! module of the trial's, so that `--checkpoint` can rewrite the `nn::seq()`/`nn::seq_t()`
//! builders inside it as it does those of earlier cells. The module builds the same variables
//! under the same names, so the notebook's weights copy into it as into any rebuilt model.

use std::collections::HashMap;

use syn::{Item, Stmt, UseTree};

use crate::rewrite::cell;

/// Reads a module of a dependency by its path (`["tch", "vision", "resnet"]`): the text of its
/// source file, where the dependency's sources can be found.
pub type ModuleSources<'a> = &'a dyn Fn(&[String]) -> Option<LibraryModule>;

/// A library module's source, as [`ModuleSources`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibraryModule {
    /// Its file, for the user (`tch-0.24.0/src/vision/resnet.rs`).
    pub file: String,
    /// Its text.
    pub code: String,
}

/// What each name a `use` of `code` brings in stands for (`resnet` → `tch::vision::resnet`);
/// renames (`as`) by their new name; globs are left out.
pub(super) fn imports(code: &str) -> HashMap<String, Vec<String>> {
    let mut names = HashMap::new();
    let Ok(parsed) = cell::parse(code) else {
        return names;
    };
    for stmt in &parsed.block.stmts {
        if let Stmt::Item(Item::Use(item)) = stmt {
            walk(&item.tree, &mut Vec::new(), &mut names);
        }
    }
    names
}

fn walk(tree: &UseTree, prefix: &mut Vec<String>, names: &mut HashMap<String, Vec<String>>) {
    match tree {
        UseTree::Path(path) => {
            prefix.push(path.ident.to_string());
            walk(&path.tree, prefix, names);
            prefix.pop();
        }
        UseTree::Name(name) if name.ident == "self" => {
            if let Some(last) = prefix.last() {
                names.insert(last.clone(), prefix.clone());
            }
        }
        UseTree::Name(name) => {
            let mut full = prefix.clone();
            full.push(name.ident.to_string());
            names.insert(name.ident.to_string(), full);
        }
        UseTree::Rename(rename) => {
            let mut full = prefix.clone();
            full.push(rename.ident.to_string());
            names.insert(rename.rename.to_string(), full);
        }
        UseTree::Group(group) => {
            for tree in &group.items {
                walk(tree, prefix, names);
            }
        }
        UseTree::Glob(_) => {}
    }
}

/// The whole path of a function a cell calls as `path`, by the imports in force: its first
/// segment replaced by what it was imported as (`resnet::resnet18` → `tch::vision::resnet::
/// resnet18`). `None` for a path inside the cell's own crate.
pub(super) fn resolve(
    path: &[String],
    imports: &HashMap<String, Vec<String>>,
) -> Option<Vec<String>> {
    let (first, rest) = path.split_first()?;
    if matches!(first.as_str(), "crate" | "self" | "super") {
        return None;
    }
    let mut full = imports
        .get(first)
        .cloned()
        .unwrap_or_else(|| vec![first.clone()]);
    full.extend(rest.iter().cloned());
    (full.len() >= 2).then_some(full)
}

/// The name the module takes in the trial's code (`__tchmem_resnet`), clear of the cell's own.
pub(super) fn module_name(module: &[String]) -> String {
    format!(
        "__tchmem_{}",
        module.last().map_or("library", String::as_str)
    )
}

/// `module`'s source as an item of the trial's code: `mod NAME { … }` holding its `use` lines
/// and the items `function` reaches (what it calls, the types it names, their impls), its paths
/// from its own crate's root written from the crate (`crate::nn` → `tch::nn`) and those to its
/// parent written whole (`super::` → `tch::vision::`). `None` where its text does not parse, or
/// holds no `function`.
pub(super) fn as_item(
    name: &str,
    module: &[String],
    source: &str,
    function: &str,
) -> Option<String> {
    let (krate, inner) = module.split_first()?;
    let parent = std::iter::once(krate.as_str())
        .chain(
            inner[..inner.len().saturating_sub(1)]
                .iter()
                .map(String::as_str),
        )
        .collect::<Vec<_>>()
        .join("::");
    let code = source
        .replace("crate::", &format!("{krate}::"))
        .replace("super::", &format!("{parent}::"));
    let file = syn::parse_file(&code).ok()?;
    let items = reached_from(function, file.items)?;
    let body = prettyplease::unparse(&syn::File {
        shebang: None,
        attrs: Vec::new(),
        items,
    });
    // Of its `use` lines, the items left out may have needed some.
    Some(format!("#[allow(unused_imports)]\nmod {name} {{\n{body}}}"))
}

/// The `use` items of `items` and those `function` reaches through the names their code holds,
/// in the file's order; `None` without `function`.
fn reached_from(function: &str, items: Vec<Item>) -> Option<Vec<Item>> {
    let named = |item: &Item| -> Option<String> {
        Some(match item {
            Item::Fn(f) => f.sig.ident.to_string(),
            Item::Struct(s) => s.ident.to_string(),
            Item::Enum(e) => e.ident.to_string(),
            Item::Const(c) => c.ident.to_string(),
            Item::Static(s) => s.ident.to_string(),
            Item::Type(t) => t.ident.to_string(),
            Item::Trait(t) => t.ident.to_string(),
            Item::Impl(i) => match &*i.self_ty {
                syn::Type::Path(p) => p.path.segments.last()?.ident.to_string(),
                _ => return None,
            },
            _ => return None,
        })
    };
    let mut kept = vec![false; items.len()];
    let mut todo = vec![function.to_string()];
    let mut seen = std::collections::HashSet::new();
    while let Some(next) = todo.pop() {
        if !seen.insert(next.clone()) {
            continue;
        }
        for (i, item) in items.iter().enumerate() {
            if !kept[i] && named(item).as_deref() == Some(next.as_str()) {
                kept[i] = true;
                let tokens = quote::ToTokens::to_token_stream(item);
                todo.extend(super::definitions::names_in(tokens));
            }
        }
    }
    if !items
        .iter()
        .zip(&kept)
        .any(|(item, kept)| *kept && matches!(item, Item::Fn(f) if f.sig.ident == function))
    {
        return None;
    }
    Some(
        items
            .into_iter()
            .zip(kept)
            .filter(|(item, kept)| *kept || matches!(item, Item::Use(_)))
            .map(|(item, _)| item)
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(text: &str) -> Vec<String> {
        text.split("::").map(str::to_string).collect()
    }

    #[test]
    fn a_library_path_resolves_through_the_imports_in_force() {
        let imports = imports(
            "use tch::vision::resnet;\nuse tch::{nn, vision::{vgg as v, densenet::{self}}};\n\
             use tch::vision::resnet::resnet34;\nuse std::io::*;",
        );
        let resolved = |p: &str| resolve(&path(p), &imports).map(|p| p.join("::"));
        assert_eq!(
            resolved("resnet::resnet18").as_deref(),
            Some("tch::vision::resnet::resnet18")
        );
        assert_eq!(
            resolved("v::vgg16").as_deref(),
            Some("tch::vision::vgg::vgg16")
        );
        assert_eq!(
            resolved("densenet::densenet121").as_deref(),
            Some("tch::vision::densenet::densenet121")
        );
        assert_eq!(
            resolved("resnet34").as_deref(),
            Some("tch::vision::resnet::resnet34")
        );
        assert_eq!(
            resolved("tch::vision::resnet::resnet18").as_deref(),
            Some("tch::vision::resnet::resnet18")
        );
        // A function of the cell's own crate, or one not imported from anywhere.
        assert_eq!(resolved("crate::net"), None);
        assert_eq!(resolved("net"), None);
    }

    #[test]
    fn a_library_module_becomes_an_item_of_what_the_function_reaches() {
        let source = "//! ResNet.\nuse crate::{nn, nn::FuncT};\nuse super::dataset::Dataset;\n\
                      struct Shape(i64);\nimpl Shape { fn get(&self) -> i64 { self.0 } }\n\
                      fn width() -> Shape { Shape(3) }\nfn unused() {}\n\
                      /// The model.\npub fn f(p: &nn::Path) -> FuncT<'static> { let _ = width().get(); todo!() }\n";
        let item = as_item("__tchmem_resnet", &path("tch::vision::resnet"), source, "f").unwrap();
        assert!(item.contains("\nmod __tchmem_resnet {"), "{item}");
        assert!(item.contains("use tch::{nn, nn::FuncT};"), "{item}");
        assert!(
            item.contains("use tch::vision::dataset::Dataset;"),
            "{item}"
        );
        assert!(item.contains("/// The model."), "{item}");
        for reached in ["fn width", "struct Shape", "impl Shape", "pub fn f"] {
            assert!(item.contains(reached), "{reached}: {item}");
        }
        assert!(
            !item.contains("fn unused") && !item.contains("//!"),
            "{item}"
        );
        syn::parse_str::<syn::Item>(&item).unwrap();
        assert_eq!(as_item("m", &path("tch::x"), "fn (", "f"), None);
        assert_eq!(as_item("m", &path("tch::x"), source, "g"), None);
        assert_eq!(module_name(&path("tch::vision::resnet")), "__tchmem_resnet");
    }
}
