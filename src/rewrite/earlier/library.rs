//! Models built by a library's function (`resnet::resnet18(&vs.root(), 10)` from `tch::vision`):
//! the function's module, read from the dependency's own sources, goes in front of the cell as a
//! module of the trial's, so that `--checkpoint` can rewrite the `nn::seq()`/`nn::seq_t()`
//! builders inside it as it does those of earlier cells. The module builds the same variables
//! under the same names, so the notebook's weights copy into it as into any rebuilt model.

use std::collections::HashMap;

use syn::{Item, Stmt, UseTree};

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

/// What each name a top-level `use` of a cell's `block` brings in stands for (`resnet` →
/// `tch::vision::resnet`); renames (`as`) by their new name; globs are left out.
pub(super) fn imports(block: &syn::Block) -> HashMap<String, Vec<String>> {
    let mut names = HashMap::new();
    for stmt in &block.stmts {
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
        // `{self as r}` names the prefix itself.
        UseTree::Rename(rename) if rename.ident == "self" => {
            names.insert(rename.rename.to_string(), prefix.clone());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rewrite::cell;

    fn path(text: &str) -> Vec<String> {
        text.split("::").map(str::to_string).collect()
    }

    #[test]
    fn a_library_path_resolves_through_the_imports_in_force() {
        let cell = cell::parse(
            "use tch::vision::resnet;\nuse tch::{nn, vision::{vgg as v, densenet::{self}}};\n\
             use tch::vision::resnet::resnet34;\nuse std::io::*;\n\
             use tch::vision::{mobilenet::{self as mn}};",
        )
        .unwrap();
        let imports = imports(&cell.block);
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
            resolved("mn::v2").as_deref(),
            Some("tch::vision::mobilenet::v2")
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
    fn the_module_takes_a_name_clear_of_the_cells() {
        assert_eq!(module_name(&path("tch::vision::resnet")), "__tchmem_resnet");
    }
}
