//! Answers `is_complete_request`: is this Rust cell finished, or does the user still type?
//!
//! Docs: https://jupyter-client.readthedocs.io/en/stable/messaging.html#code-completeness
//!
//! First a small lexer that knows Rust's strings, raw strings, char literals (versus lifetimes)
//! and nested comments, and tracks brackets: unclosed brackets or an unterminated string or
//! comment mean "incomplete", a closing bracket that does not match means "invalid". Code the
//! lexer finds balanced is then parsed (see [`crate::cell_syntax`]): a parse that stops at the
//! end of the cell (`let x =`) is "incomplete", any other syntax error "invalid" (no added line
//! can fix it). What the parser does not judge stays "complete": running the cell tells more.

use crate::cell_syntax::{self, Syntax};

/// The verdict, with the indent to continue with when incomplete.
#[derive(Debug, PartialEq, Eq)]
pub enum Completeness {
    /// Ready to run.
    Complete,
    /// Needs more lines; the string is the indent for the next one.
    Incomplete(String),
    /// Cannot become valid by adding text.
    Invalid,
}

/// Judges `code`.
pub fn judge(code: &str) -> Completeness {
    match brackets(code) {
        Completeness::Complete => match cell_syntax::read(code) {
            Syntax::Valid(_) | Syntax::Unknown => Completeness::Complete,
            Syntax::Unfinished { indent } => Completeness::Incomplete(" ".repeat(indent)),
            Syntax::Invalid => Completeness::Invalid,
        },
        other => other,
    }
}

/// The lexer's verdict: brackets, strings and comments only.
fn brackets(code: &str) -> Completeness {
    let chars: Vec<char> = code.chars().collect();
    let mut open: Vec<char> = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        match c {
            '/' if next == Some('/') => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '/' if next == Some('*') => match skip_block_comment(&chars, i) {
                Some(end) => i = end,
                None => return incomplete(open.len()),
            },
            '"' => match skip_string(&chars, i + 1) {
                Some(end) => i = end,
                None => return incomplete(open.len()),
            },
            'r' if starts_raw_string(&chars, i) => match skip_raw_string(&chars, i + 1) {
                Some(end) => i = end,
                None => return incomplete(open.len()),
            },
            '\'' => i = skip_char_literal(&chars, i),
            '(' | '[' | '{' => open.push(c),
            ')' | ']' | '}' => {
                let expected = match c {
                    ')' => '(',
                    ']' => '[',
                    _ => '{',
                };
                if open.pop() != Some(expected) {
                    return Completeness::Invalid;
                }
            }
            _ => {}
        }
        i += 1;
    }
    if open.is_empty() {
        Completeness::Complete
    } else {
        incomplete(open.len())
    }
}

fn incomplete(depth: usize) -> Completeness {
    Completeness::Incomplete("    ".repeat(depth))
}

/// From the `/` of `/*`, returns the index of the final `/`, or `None` if unterminated.
fn skip_block_comment(chars: &[char], start: usize) -> Option<usize> {
    let mut depth = 0;
    let mut i = start;
    while i + 1 < chars.len() {
        match (chars[i], chars[i + 1]) {
            ('/', '*') => {
                depth += 1;
                i += 2;
            }
            ('*', '/') => {
                depth -= 1;
                i += 2;
                if depth == 0 {
                    return Some(i - 1);
                }
            }
            _ => i += 1,
        }
    }
    None
}

/// From just after the opening quote, returns the index of the closing quote.
fn skip_string(chars: &[char], mut i: usize) -> Option<usize> {
    while i < chars.len() {
        match chars[i] {
            '\\' => i += 2,
            '"' => return Some(i),
            _ => i += 1,
        }
    }
    None
}

/// `r"` or `r#…"` not preceded by an identifier character (`br"` counts).
fn starts_raw_string(chars: &[char], i: usize) -> bool {
    let before = i.checked_sub(1).map(|p| chars[p]);
    let standalone = match before {
        Some('b') => i < 2 || !is_ident(chars[i - 2]),
        Some(p) => !is_ident(p),
        None => true,
    };
    let mut j = i + 1;
    while chars.get(j) == Some(&'#') {
        j += 1;
    }
    standalone && chars.get(j) == Some(&'"')
}

/// From just after `r`, returns the index of the last character of the raw string.
fn skip_raw_string(chars: &[char], mut i: usize) -> Option<usize> {
    let mut hashes = 0;
    while chars.get(i) == Some(&'#') {
        hashes += 1;
        i += 1;
    }
    i += 1; // the opening quote
    while i < chars.len() {
        if chars[i] == '"' && (1..=hashes).all(|k| chars.get(i + k) == Some(&'#')) {
            return Some(i + hashes);
        }
        i += 1;
    }
    None
}

/// From a `'`: skips a char literal (`'a'`, `'\n'`, `'\u{1F600}'`); a lifetime is left alone.
fn skip_char_literal(chars: &[char], start: usize) -> usize {
    match chars.get(start + 1) {
        Some('\\') => {
            // Skip the escaped character itself: it may be a quote ('\'').
            let mut i = start + 3;
            while i < chars.len() && chars[i] != '\'' && chars[i] != '\n' {
                i += 1;
            }
            i
        }
        Some(_) if chars.get(start + 2) == Some(&'\'') => start + 2,
        _ => start,
    }
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

#[cfg(test)]
mod tests {
    use super::{judge, Completeness::*};

    #[test]
    fn balanced_code_is_complete() {
        assert_eq!(judge("let x = vec![1, 2];\nx.len()"), Complete);
        assert_eq!(judge(""), Complete);
        assert_eq!(judge(":dep tch = { version = \"0.24\" }"), Complete);
        assert_eq!(judge("fn f<'a>(x: &'a str) -> &'a str { x }"), Complete);
        assert_eq!(judge("let c = '{'; let d = '\\''; let e = b'}';"), Complete);
        assert_eq!(judge("let p = ('\\'', '{');"), Complete);
        assert_eq!(judge("let s = \"}\"; // {\n/* { /* } */ } */"), Complete);
        assert_eq!(judge("let s = r#\"a \" } \"#;"), Complete);
        assert_eq!(judge("let s = br\"{\";"), Complete);
    }

    #[test]
    fn open_brackets_strings_and_comments_are_incomplete() {
        assert_eq!(judge("fn f() {"), Incomplete("    ".into()));
        assert_eq!(
            judge("fn f() {\n    let v = vec![(1,"),
            Incomplete("            ".into())
        );
        assert_eq!(judge("let s = \"abc"), Incomplete(String::new()));
        assert_eq!(judge("let s = r##\"abc\"#"), Incomplete(String::new()));
        assert_eq!(judge("/* unfinished"), Incomplete(String::new()));
    }

    #[test]
    fn mismatched_closers_are_invalid() {
        assert_eq!(judge("fn f() { )"), Invalid);
        assert_eq!(judge("}"), Invalid);
    }

    #[test]
    fn syntax_errors_no_line_can_fix_are_invalid() {
        for code in [
            "let x = ;",
            "1 + / 2",
            "let = 5;",
            "let x = 5 5;",
            "fn 1f() {}",
            "struct { x: u8 }",
            "println!(\"a\") println!(\"b\");",
            "fn f() {\n    let y = 1 +\n}",
            "let v = [1, 2,, 3];",
            "let x = 1;\n:vars",
            "%memprofile off\nlet x = ;",
            "%%optimize --amp bf16\nlet x = ;",
        ] {
            assert_eq!(judge(code), Invalid, "{code:?}");
        }
    }

    #[test]
    fn code_that_stops_too_early_is_incomplete() {
        assert_eq!(judge("let x ="), Incomplete(String::new()));
        assert_eq!(judge("let total = a\n    + b +"), Incomplete("    ".into()));
        assert_eq!(judge("#[derive(Debug)]"), Incomplete(String::new()));
        assert_eq!(judge("fn f()"), Incomplete(String::new()));
    }

    #[test]
    fn evcxr_cells_that_are_not_plain_blocks_stay_complete() {
        for code in [
            ":dep rand = \"0.8\"\nrand::random::<u8>()",
            "  :vars",
            "!ls\n// a comment\n:timing\nlet x = 1;",
            "%memprofile always\n%memhistory",
            "%%optimize --help",
            "%%optimize --amp bf16 --show\nlet x = 1;\nx",
            "use std::collections::HashMap;\nstruct S;\nimpl S { fn f(&self) {} }\nS.f()",
            "#![allow(unused)]\nlet x = 1;",
            "let x = async { 1 }.await;",
            "let n: i32 = \"5\".parse()?;\nn",
            "1 +* 2", // `1 + (*2)`: a type error, not a syntax error
            "macro_rules! m { () => { 1 } }\nm!()",
            "'outer: for i in 0..3 { break 'outer; }",
            "let Some(x) = Some(1) else { panic!() };",
            "extern crate std;",
        ] {
            assert_eq!(judge(code), Complete, "{code:?}");
        }
    }

    /// Every code cell of the project's notebooks and every training loop the rewriter is
    /// tested on (original and rewritten) is a cell users run: all must be complete.
    #[test]
    fn every_notebook_cell_and_reference_loop_is_complete() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut cells = Vec::new();
        for dir in ["notebooks"] {
            for entry in std::fs::read_dir(root.join(dir)).unwrap() {
                let path = entry.unwrap().path();
                if path.extension().is_some_and(|e| e == "ipynb") {
                    let text = std::fs::read_to_string(&path).unwrap();
                    let notebook: serde_json::Value = serde_json::from_str(&text).unwrap();
                    for cell in notebook["cells"].as_array().unwrap() {
                        if cell["cell_type"] == "code" {
                            let source = match &cell["source"] {
                                serde_json::Value::Array(lines) => {
                                    lines.iter().filter_map(|l| l.as_str()).collect()
                                }
                                other => other.as_str().unwrap_or_default().to_string(),
                            };
                            cells.push((path.display().to_string(), source));
                        }
                    }
                }
            }
        }
        for dir in ["tests/loops", "tests/loops/rewritten"] {
            for entry in std::fs::read_dir(root.join(dir)).unwrap() {
                let path = entry.unwrap().path();
                let name = path.file_name().unwrap().to_string_lossy().to_string();
                if name.ends_with(".rs") && name != "lib.rs" && name != "build.rs" {
                    cells.push((name, std::fs::read_to_string(&path).unwrap()));
                }
            }
        }
        assert!(cells.len() > 40, "found only {} cells", cells.len());
        for (origin, cell) in &cells {
            assert_eq!(judge(cell), Complete, "{origin}:\n{cell}");
        }
    }
}
