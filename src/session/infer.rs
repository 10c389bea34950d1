//! When evcxr's code analysis cannot tell the type of a variable a cell defines (it keeps every
//! variable between cells, so it must name its type), ask the compiler instead of failing the
//! cell: compile the cell once more inside `if false { … }` with `let _: () = variable;` after
//! it, read the type from rustc's "expected `()`, found `T`", and run the cell with the type
//! written out. Nothing runs during the probe: it never compiles.

use syn::{Pat, Stmt};

/// The variable named by evcxr's "Couldn't automatically determine type of variable `x`".
pub fn unknown_variable(message: &str) -> Option<&str> {
    message
        .strip_prefix("Couldn't automatically determine type of variable `")?
        .split('`')
        .next()
}

/// A top-level `let` without a type: where `: T` goes, and its pattern as an expression.
#[derive(Debug, PartialEq)]
pub struct Untyped {
    /// Byte offset in the cell just after the pattern.
    pub insert_at: usize,
    /// The pattern's variables as an expression of the same type (`x`, `(a, b)`).
    pub probe: String,
}

/// The cell's top-level `let` statements that have no type and a plain pattern (names and
/// tuples of names). `None` when the cell is not plain Rust statements.
pub fn untyped_lets(code: &str) -> Option<Vec<Untyped>> {
    if code.trim_start().starts_with(':') {
        return None; // evcxr commands: not Rust
    }
    // Line 1 is the brace; the cell's line k is line k + 1.
    let block: syn::Block = syn::parse_str(&format!("{{\n{code}\n}}")).ok()?;
    let mut found = Vec::new();
    for statement in &block.stmts {
        let Stmt::Local(local) = statement else {
            continue;
        };
        if local.init.is_none() || matches!(local.pat, Pat::Type(_)) {
            continue;
        }
        let Some(probe) = pattern_expression(&local.pat) else {
            continue;
        };
        let end = syn::spanned::Spanned::span(&local.pat).end();
        found.push(Untyped {
            insert_at: super::positions::offset_in_block(code, end)?,
            probe,
        });
    }
    Some(found)
}

fn pattern_expression(pattern: &Pat) -> Option<String> {
    match pattern {
        Pat::Ident(ident) if ident.by_ref.is_none() && ident.subpat.is_none() => {
            Some(ident.ident.to_string())
        }
        Pat::Tuple(tuple) => {
            let parts: Option<Vec<String>> = tuple.elems.iter().map(pattern_expression).collect();
            let parts = parts?;
            Some(match parts.len() {
                1 => format!("({},)", parts[0]),
                _ => format!("({})", parts.join(", ")),
            })
        }
        _ => None,
    }
}

/// The probe: the cell, never run, then one `let _: () = …;` per untyped `let`.
pub fn probe_cell(code: &str, lets: &[Untyped]) -> String {
    let probes: String = lets
        .iter()
        .map(|l| format!("let _: () = {};\n", l.probe))
        .collect();
    format!("{{ if false {{\n{code}\n;\n{probes}}} }}")
}

/// The type rustc names in a mismatch with `()`, if it is one a program can write.
pub fn found_type(rendered: &str) -> Option<String> {
    let after = rendered.split("expected `()`, found `").nth(1)?;
    let found = after.split('`').next()?.trim();
    let writable =
        !found.is_empty() && !found.contains('{') && !found.contains("impl ") && found != "()";
    writable.then(|| found.to_string())
}

/// The type rustc cannot find and the import it suggests for it (the type the compiler named
/// for a variable may be one the cell has not imported): its one candidate, or among several
/// the one from std. `None` for any other error.
pub fn suggested_import(rendered: &str) -> Option<(String, String)> {
    let rendered = without_colours(rendered);
    let name = rendered
        .split("cannot find type `")
        .nth(1)?
        .split('`')
        .next()?
        .to_string();
    // rustc shows each candidate as an added line: `1 + use std::collections::VecDeque;`.
    let candidates: Vec<&str> = rendered
        .lines()
        .filter_map(|line| line.split_once("+ use ")?.1.trim().strip_suffix(';'))
        .collect();
    let from_std: Vec<&str> = candidates
        .iter()
        .copied()
        .filter(|path| path.starts_with("std::"))
        .collect();
    match (candidates.as_slice(), from_std.as_slice()) {
        ([one], _) | (_, [one]) => Some((name, one.to_string())),
        _ => None,
    }
}

/// Whether `code` has `name` as a word of its own (not as part of a longer identifier).
pub fn names(code: &str, name: &str) -> bool {
    code.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .any(|word| word == name)
}

/// `text` without its ANSI colour sequences (evcxr asks cargo for coloured renderings:
/// `--json=diagnostic-rendered-ansi` on rustc's command line).
pub(super) fn without_colours(text: &str) -> String {
    let mut plain = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC [ parameters, ended by a letter.
            chars.by_ref().find(|c| c.is_ascii_alphabetic());
        } else {
            plain.push(c);
        }
    }
    plain
}

/// The cell with `: T` after each pattern.
pub fn annotate(code: &str, lets: &[Untyped], types: &[String]) -> String {
    let mut annotated = code.to_string();
    for (untyped, found) in lets.iter().zip(types).rev() {
        annotated.insert_str(untyped.insert_at, &format!(": {found}"));
    }
    annotated
}

#[cfg(test)]
mod tests {
    use super::{
        annotate, found_type, names, probe_cell, suggested_import, unknown_variable, untyped_lets,
    };

    #[test]
    fn finds_the_variable_evcxr_could_not_type() {
        let message = "Couldn't automatically determine type of variable `hi`.\nPlease give it \
                       an explicit type.";
        assert_eq!(unknown_variable(message), Some("hi"));
        assert_eq!(unknown_variable("something else"), None);
    }

    #[test]
    fn untyped_lets_are_found_with_their_patterns_also_after_non_ascii_text() {
        let code = "// → Chinese: 损失\nlet x: i32 = 1;\nlet (lo, mut hi) = (1.0, 2.0);\n\
                    let é = vec![1];\nlet _ = 3;";
        let lets = untyped_lets(code).unwrap();
        let probes: Vec<&str> = lets.iter().map(|l| l.probe.as_str()).collect();
        assert_eq!(probes, ["(lo, hi)", "é"]);
        let annotated = annotate(code, &lets, &["(f64, f64)".into(), "Vec<i32>".into()]);
        assert!(annotated.contains("let (lo, mut hi): (f64, f64) = (1.0, 2.0);"));
        assert!(annotated.contains("let é: Vec<i32> = vec![1];"));
        assert!(probe_cell(code, &lets).contains("let _: () = (lo, hi);"));
    }

    #[test]
    fn commands_and_unparsable_cells_get_no_fallback() {
        assert!(untyped_lets(":dep rand = \"0.8\"\nlet x = 1;").is_none());
        assert!(untyped_lets("let x = ;").is_none());
    }

    #[test]
    fn the_found_type_is_read_and_unwritable_ones_are_refused() {
        let rendered = "error[E0308]: mismatched types\n  |\n3 | let _: () = (lo, hi);\n  |   \
                        expected `()`, found `(f64, f64)`";
        assert_eq!(found_type(rendered).as_deref(), Some("(f64, f64)"));
        assert_eq!(found_type("expected `()`, found `{float}`"), None);
        assert_eq!(
            found_type("expected `()`, found `{closure@src/lib.rs:3:9}`"),
            None
        );
    }

    #[test]
    fn the_import_rustc_suggests_for_a_type_it_cannot_find_is_read() {
        // As rustc 1.95 renders them.
        let one = "error[E0425]: cannot find type `__m128i` in this scope\n --> src/lib.rs:1:21\n\
                   help: consider importing this struct\n  |\n1 + use std::arch::x86_64::__m128i;\n  |\n";
        let found = |rendered| suggested_import(rendered).map(|(_, path)| path);
        assert_eq!(
            suggested_import(one),
            Some((
                "__m128i".to_string(),
                "std::arch::x86_64::__m128i".to_string()
            ))
        );
        let several = "error[E0425]: cannot find type `HashMap` in this scope\n\
                       help: consider importing one of these items\n  |\n\
                       1 + use hashbrown::HashMap;\n  |\n1 + use std::collections::HashMap;\n";
        assert_eq!(found(several).as_deref(), Some("std::collections::HashMap"));
        let coloured = "\u{1b}[0m\u{1b}[1m\u{1b}[38;5;9merror[E0425]\u{1b}[0m\u{1b}[1m: cannot find \
                        type `VecDeque` in this scope\u{1b}[0m\n\u{1b}[0m\u{1b}[1m\u{1b}[38;5;12m1\
                        \u{1b}[0m\u{1b}[0m \u{1b}[0m\u{1b}[0m\u{1b}[38;5;10m+ use std::collections::\
                        VecDeque;\u{1b}[0m\n";
        assert_eq!(
            found(coloured).as_deref(),
            Some("std::collections::VecDeque")
        );
        let ambiguous = "error[E0425]: cannot find type `Linear` in this scope\n\
                         1 + use a::Linear;\n1 + use b::Linear;\n";
        assert_eq!(suggested_import(ambiguous), None);
        let other = "error[E0308]: mismatched types\n1 + use std::fmt::Debug;\n";
        assert_eq!(suggested_import(other), None);
    }

    #[test]
    fn a_name_counts_as_written_only_as_a_word_of_its_own() {
        assert!(names("let y: HashMap<i32, i32> = x;", "HashMap"));
        assert!(names("HashMap::new()", "HashMap"));
        assert!(!names("let m = MyHashMap::new();", "HashMap"));
        assert!(!names(
            "let lanes = unsafe { _mm_set1_epi32(7) };",
            "__m128i"
        ));
        assert!(!names("let h = HashMapper;", "HashMap"));
    }
}
