//! A check at the start of every loop body of a cell's code, where an interrupt stops the cell
//! with its variables kept, and where the live view counts iterations (see
//! `tchmem::interrupt`).
//!
//! The check goes right after the body's `{`, on the same line, so every line keeps its number
//! (compile errors, panics and the stop message name the user's lines). Loops where a call is not
//! allowed (`const fn`, `const` and `static` items, `const` blocks) and loops inside macros (not
//! parsed) get none; a loop in a `fn` of the cell is named by its function.

use proc_macro2::LineColumn;
use syn::visit::{self, Visit};
use syn::{AttrStyle, Attribute, Block, ExprForLoop, ExprLoop, ExprWhile};

use super::positions::offset_in_block;
use crate::cell_syntax;

/// The environment variable that turns the checks off when set to `0`.
pub const LOOP_CHECKS_ENV: &str = "TCHMEM_LOOP_CHECKS";

/// What the inserted check starts with (and what [`strip`] looks for).
const CHECK_PREFIX: &str = "::tchmem::__at_loop!(";

/// Whether cells get loop checks (read once per process).
pub fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var(LOOP_CHECKS_ENV).map_or(true, |v| v != "0"))
}

/// `code` with a check at the start of each loop body; `None` when it has no loop (or does not
/// parse: evcxr then says why).
pub fn insert(code: &str) -> Option<String> {
    if !code.contains("for") && !code.contains("while") && !code.contains("loop") {
        return None;
    }
    let bodies = cell_syntax::with_parsed_block(code, |block| {
        let mut finder = Loops::default();
        finder.visit_block(block);
        finder.found
    })?;
    let mut inserts: Vec<(usize, String)> = bodies
        .into_iter()
        .filter_map(|(keyword, brace, function)| {
            let at = offset_in_block(code, brace)? + 1;
            // Parser line 2 is the cell's first line.
            let line = keyword.line.checked_sub(1)?;
            Some((at, format!("{CHECK_PREFIX}{line}, {function:?});")))
        })
        .collect();
    if inserts.is_empty() {
        return None;
    }
    inserts.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
    let mut out = code.to_string();
    for (at, check) in inserts {
        if !out.is_char_boundary(at) || out.as_bytes().get(at - 1) != Some(&b'{') {
            return None; // not where the parser said: leave the cell as it is
        }
        out.insert_str(at, &check);
    }
    Some(out)
}

/// `code` without the checks [`insert`] put in (for showing the user their own code).
pub fn strip(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(start) = rest.find(CHECK_PREFIX) {
        out.push_str(&rest[..start]);
        let after = &rest[start..];
        match after.find(");") {
            Some(end) => rest = &after[end + 2..],
            None => {
                out.push_str(after);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// The (line, column) in the code without checks of a position in `checked` (1-based; columns
/// count characters): the checks before it on its line are taken out, and a position inside a
/// check moves to where the check was.
pub fn user_position(checked: &str, (line, column): (usize, usize)) -> (usize, usize) {
    let Some(text) = checked.lines().nth(line.saturating_sub(1)) else {
        return (line, column);
    };
    let mut removed = 0;
    let mut from = 0;
    while let Some(found) = text[from..].find(CHECK_PREFIX) {
        let start = from + found;
        let end = text[start..]
            .find(");")
            .map_or(text.len(), |e| start + e + 2);
        let (start_column, end_column) = (
            text[..start].chars().count() + 1,
            text[..end].chars().count() + 1,
        );
        if column < start_column {
            break;
        }
        let inside = column < end_column;
        removed += if inside {
            column - start_column
        } else {
            end_column - start_column
        };
        if inside {
            break;
        }
        from = end;
    }
    (line, column - removed)
}

/// Whether a compile error is about an inserted check rather than the user's code: its message
/// names the check, or one of its spans comes from the check's macro (rustc's JSON `expansion`).
/// The rendered source is not read: a user's error on a loop's line shows the check there.
pub fn about_a_check(message: &str, json: &serde_json::Value) -> bool {
    fn expanded_from_a_check(value: &serde_json::Value) -> bool {
        match value {
            serde_json::Value::Object(map) => map.iter().any(|(key, value)| {
                (key == "macro_decl_name"
                    && value
                        .as_str()
                        .is_some_and(|name| name.contains("__at_loop")))
                    || (key != "rendered" && expanded_from_a_check(value))
            }),
            serde_json::Value::Array(items) => items.iter().any(expanded_from_a_check),
            _ => false,
        }
    }
    message.contains("__at_loop") || expanded_from_a_check(json)
}

/// Loop bodies found: the loop keyword's position, the body's `{`, and the function it is in.
#[derive(Default)]
struct Loops {
    found: Vec<(LineColumn, LineColumn, String)>,
    function: Vec<String>,
}

fn has_inner_attribute(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|a| matches!(a.style, AttrStyle::Inner(_)))
}

/// Whether `body` asks `interrupted()` itself: it stops as it chooses (a check before it would
/// take the request first).
fn asks_itself(body: &Block) -> bool {
    use quote::ToTokens;
    body.to_token_stream().to_string().contains("interrupted")
}

impl Loops {
    fn body(&mut self, keyword: LineColumn, attrs: &[Attribute], body: &Block) {
        // An inner attribute must stay first in the body.
        if !has_inner_attribute(attrs) && !asks_itself(body) {
            let function = self.function.last().cloned().unwrap_or_default();
            self.found
                .push((keyword, body.brace_token.span.open().start(), function));
        }
    }
}

impl<'ast> Visit<'ast> for Loops {
    fn visit_expr_for_loop(&mut self, node: &'ast ExprForLoop) {
        self.body(node.for_token.span.start(), &node.attrs, &node.body);
        visit::visit_expr_for_loop(self, node);
    }

    fn visit_expr_while(&mut self, node: &'ast ExprWhile) {
        self.body(node.while_token.span.start(), &node.attrs, &node.body);
        visit::visit_expr_while(self, node);
    }

    fn visit_expr_loop(&mut self, node: &'ast ExprLoop) {
        self.body(node.loop_token.span.start(), &node.attrs, &node.body);
        visit::visit_expr_loop(self, node);
    }

    fn visit_item_fn(&mut self, node: &'ast syn::ItemFn) {
        // `extern "C"` fns: unwinding out of them aborts the process.
        if node.sig.constness.is_none() && node.sig.abi.is_none() {
            self.function.push(node.sig.ident.to_string());
            visit::visit_item_fn(self, node);
            self.function.pop();
        }
    }

    fn visit_impl_item_fn(&mut self, node: &'ast syn::ImplItemFn) {
        if node.sig.constness.is_none() && node.sig.abi.is_none() {
            self.function.push(node.sig.ident.to_string());
            visit::visit_impl_item_fn(self, node);
            self.function.pop();
        }
    }

    fn visit_trait_item_fn(&mut self, node: &'ast syn::TraitItemFn) {
        if node.sig.constness.is_none() {
            self.function.push(node.sig.ident.to_string());
            visit::visit_trait_item_fn(self, node);
            self.function.pop();
        }
    }

    // Constant contexts: no calls allowed.
    fn visit_item_const(&mut self, _: &'ast syn::ItemConst) {}
    fn visit_item_static(&mut self, _: &'ast syn::ItemStatic) {}
    fn visit_expr_const(&mut self, _: &'ast syn::ExprConst) {}
    fn visit_impl_item_const(&mut self, _: &'ast syn::ImplItemConst) {}
    fn visit_trait_item_const(&mut self, _: &'ast syn::TraitItemConst) {}
    fn visit_expr_repeat(&mut self, node: &'ast syn::ExprRepeat) {
        // `[x; N]`: the element may loop, the length is constant.
        self.visit_expr(&node.expr);
    }
    fn visit_type(&mut self, _: &'ast syn::Type) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_loop_body_gets_a_check_on_its_own_line() {
        let code = "let mut n = 0;\nfor i in 0..3 {\n    n += i;\n}\nwhile n > 0 { n -= 1; }\n\
                    fn train(k: u32) -> u32 {\n    let mut s = 0;\n    'outer: loop {\n        \
                    s += k;\n        if s > 9 { break 'outer s; }\n    }\n}";
        let checked = insert(code).unwrap();
        assert_eq!(checked.lines().count(), code.lines().count());
        let lines: Vec<&str> = checked.lines().collect();
        assert_eq!(lines[1], "for i in 0..3 {::tchmem::__at_loop!(2, \"\");");
        assert_eq!(
            lines[4],
            "while n > 0 {::tchmem::__at_loop!(5, \"\"); n -= 1; }"
        );
        assert_eq!(
            lines[7],
            "    'outer: loop {::tchmem::__at_loop!(8, \"train\");"
        );
        assert_eq!(strip(&checked), code);
        // An error after a check on its line points at the user's column.
        let at = lines[4].find("n -= 1").unwrap() + 1;
        let user = code.lines().nth(4).unwrap().find("n -= 1").unwrap() + 1;
        assert_eq!(user_position(&checked, (5, at)), (5, user));
        assert_eq!(user_position(&checked, (5, 3)), (5, 3), "before the check");
        assert_eq!(user_position(&checked, (5, 20)), (5, 14), "inside it");
    }

    #[test]
    fn constant_contexts_inner_attributes_and_loop_free_cells_are_left_alone() {
        assert_eq!(insert("let x = 1;"), None);
        assert_eq!(
            insert("const fn f() -> u32 { let mut i = 0; while i < 3 { i += 1; } i }"),
            None
        );
        assert_eq!(
            insert("const N: usize = { let mut i = 0; loop { i += 1; if i > 2 { break i; } } };"),
            None
        );
        assert_eq!(insert("for x in 0..2 { #![allow(unused)] }"), None);
        assert_eq!(
            insert("for x in 0..2 { if tchmem::interrupted() { break; } }"),
            None,
            "the loop asks itself"
        );
        assert_eq!(
            insert("extern \"C\" fn f() { for _ in 0..2 {} }"),
            None,
            "no unwinding out of an extern fn"
        );
        assert_eq!(insert("for x in 0..2 {"), None, "does not parse");
        // Multibyte text before a loop on the same line.
        let code = "let µ = [1, 2]; for v in µ { let _ = v; }";
        let checked = insert(code).unwrap();
        assert!(
            checked.contains("µ {::tchmem::__at_loop!(1, \"\"); let _"),
            "{checked}"
        );
    }

    #[test]
    fn only_errors_from_a_check_are_about_a_check() {
        let from_check = serde_json::json!({"spans": [{"expansion":
            {"macro_decl_name": "::tchmem::__at_loop!"}}]});
        assert!(about_a_check("calls in constants are limited", &from_check));
        let users = serde_json::json!({"spans": [{"text": [{"text":
            "for x in &undefined {::tchmem::__at_loop!(1, \"\");"}]}],
            "rendered": "for x in &undefined {::tchmem::__at_loop!(1, \"\");"});
        assert!(!about_a_check("cannot find value `undefined`", &users));
    }

    #[test]
    fn evcxr_commands_keep_their_lines() {
        let code = ":dep rand = \"0.8\"\nfor _ in 0..2 {}\n";
        let checked = insert(code).unwrap();
        assert!(checked.starts_with(":dep rand"));
        assert!(checked.contains("for _ in 0..2 {::tchmem::__at_loop!(2, \"\");}"));
    }
}
