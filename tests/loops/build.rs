//! Wraps each loop cell (a sequence of statements and items, as a notebook cell holds) in a
//! `#[test]` function returning a Result, so that `?` works as in evcxr.

use std::fmt::Write;
use std::path::Path;

fn cells(dir: &Path) -> Vec<(String, String)> {
    let mut found: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "rs"))
        .filter(|path| {
            !matches!(
                path.file_name().and_then(|n| n.to_str()),
                Some("lib.rs" | "build.rs")
            )
        })
        .map(|path| {
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            let code = std::fs::read_to_string(&path).unwrap();
            (name, code)
        })
        .collect();
    found.sort();
    found
}

fn test_name(prefix: &str, stem: &str) -> String {
    let cleaned: String = stem
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("{prefix}{cleaned}")
}

fn main() {
    // Read when the script runs, not when it is compiled: clones at other paths share a target
    // directory (and this script's binary) when they share a cache.
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let root = Path::new(&manifest_dir);
    println!("cargo:rerun-if-changed={}", root.display());
    println!(
        "cargo:rerun-if-changed={}",
        root.join("rewritten").display()
    );
    let mut out = String::new();
    for (prefix, dir) in [
        ("original_", root.to_path_buf()),
        ("rewritten_", root.join("rewritten")),
    ] {
        for (stem, code) in cells(&dir) {
            writeln!(
                out,
                "#[test]\n#[ignore = \"trains a model for several epochs on the CPU: run with --ignored\"]\n#[allow(unused, non_snake_case, clippy::all)]\nfn {}() -> Result<(), Box<dyn std::error::Error>> {{\n{code}\nOk(())\n}}\n",
                test_name(prefix, &stem)
            )
            .unwrap();
        }
    }
    let dest = Path::new(&std::env::var("OUT_DIR").unwrap()).join("loops.rs");
    std::fs::write(dest, out).unwrap();
}
