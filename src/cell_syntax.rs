//! What a cell's Rust syntax says before it runs: whether it can still become valid (for
//! `is_complete_request`) and whether it ends in an expression whose value evcxr will show.
//!
//! A cell is read as evcxr reads it: the kernel's `%` magic lines (or a `%%` cell magic's line)
//! and evcxr's leading `:` command, `!` shell and `//` comment lines are not Rust; the rest is a
//! block of statements and items, possibly ending in an expression. It is parsed with syn on a
//! thread of its own with a large stack, after the same size limits the rewriter uses.

use syn::{Block, Expr, Stmt};

use crate::magics;
use crate::parse_thread;

/// Cells larger than this are not parsed.
const MAX_BYTES: usize = 1 << 20;

/// Stack for the parsing thread: syn recurses once per nesting level and per unary operator.
const PARSER_STACK: usize = 64 << 20;

/// What parsing a cell found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Syntax {
    /// The cell parses; what its last statement is.
    Valid(Tail),
    /// The cell stops too early (`let x =`, `a +`, `let y = 5` without `;`): more lines could
    /// complete it.
    Unfinished {
        /// The indent of the last non-blank line, to continue with.
        indent: usize,
    },
    /// A syntax error that no added line can fix (`let x = ;`, `1 + / 2`).
    Invalid,
    /// Not judged: too large or too deep for the parser, or a form this reading does not know
    /// (inner attributes `#![…]`, which evcxr accepts at the top level of a cell).
    Unknown,
}

/// The last statement of a cell, as far as displaying its value goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tail {
    /// The cell ends with a statement, an item or nothing: evcxr shows no value.
    Statement,
    /// The cell ends in an expression whose value is always `()` (a `for` or `while` loop, an
    /// `if` without `else`, an assignment, `println!`…): evcxr shows `()`, which the kernel
    /// hides.
    Unit,
    /// The cell ends in an expression with a value to show.
    Value,
}

/// Reads `cell` (a whole cell, magics included).
pub fn read(cell: &str) -> Syntax {
    with_block(cell, |parsed, text| match parsed {
        Ok(block) => Syntax::Valid(tail(&block)),
        Err(error) => {
            // An error at the closing brace: the parser wanted more before the end
            // ("unexpected end of input, expected an expression", "expected `;`").
            let at = error.span().start();
            if at.line == text.lines().count() && at.column == 0 {
                Syntax::Unfinished {
                    indent: last_indent(text),
                }
            } else {
                Syntax::Invalid
            }
        }
    })
    .unwrap_or(Syntax::Unknown)
}

/// A `let` in a cell that binds a name to a new `VarStore`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VarStoreBinding {
    /// The variable's name.
    pub name: String,
    /// Whether the `let` is at the top of the cell (the variable outlives the cell), not inside
    /// a block, loop or function of it.
    pub top_level: bool,
    /// The cell line (0-based) of the statement's closing `;`.
    pub line: usize,
    /// The character column just after that `;`.
    pub column: usize,
}

/// The cell's `let`s that certainly bind a `VarStore`: `let vs = nn::VarStore::new(…);` or `let
/// vs: nn::VarStore = …;` (any path ending in `VarStore`), at the top of the cell or nested in
/// its blocks, loops and functions. Read from the syntax alone, before the cell compiles; a
/// store made any other way is found after the cell ran (if it is a variable of the session).
pub fn var_store_bindings(cell: &str) -> Vec<VarStoreBinding> {
    with_block(cell, |parsed, _| {
        let Ok(block) = parsed else {
            return Vec::new();
        };
        struct Lets(Vec<VarStoreBinding>, usize);
        impl<'ast> syn::visit::Visit<'ast> for Lets {
            fn visit_block(&mut self, block: &'ast Block) {
                self.1 += 1;
                syn::visit::visit_block(self, block);
                self.1 -= 1;
            }
            fn visit_local(&mut self, local: &'ast syn::Local) {
                if let Some(mut binding) = var_store_let(local) {
                    binding.top_level = self.1 == 0;
                    self.0.push(binding);
                }
                syn::visit::visit_local(self, local);
            }
        }
        let mut lets = Lets(Vec::new(), 0);
        for stmt in &block.stmts {
            syn::visit::Visit::visit_stmt(&mut lets, stmt);
        }
        lets.0
    })
    .unwrap_or_default()
}

fn var_store_let(local: &syn::Local) -> Option<VarStoreBinding> {
    let (pat, annotated) = match &local.pat {
        syn::Pat::Type(typed) => (&*typed.pat, ends_with(&typed.ty, &["VarStore"])),
        pat => (pat, false),
    };
    let syn::Pat::Ident(ident) = pat else {
        return None;
    };
    let init = local.init.as_ref().filter(|init| init.diverge.is_none())?;
    let made_here = matches!(&*init.expr, Expr::Call(call)
        if matches!(&*call.func, Expr::Path(path) if path_ends_with(&path.path, &["VarStore", "new"])));
    if !(annotated || made_here) || ident.by_ref.is_some() || ident.subpat.is_some() {
        return None;
    }
    let end = local.semi_token.span.end();
    // Lines in the parsed text start with the opening brace's line (see `with_block`).
    Some(VarStoreBinding {
        name: ident.ident.to_string(),
        top_level: true,
        line: end.line.checked_sub(2)?,
        column: end.column,
    })
}

fn ends_with(ty: &syn::Type, names: &[&str]) -> bool {
    matches!(ty, syn::Type::Path(path) if path.qself.is_none() && path_ends_with(&path.path, names))
}

fn path_ends_with(path: &syn::Path, names: &[&str]) -> bool {
    let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
    segments.len() >= names.len() && segments[segments.len() - names.len()..] == *names
}

/// The cell's top-level `use` items, as Rust text (evcxr keeps none of them when the cell fails
/// to compile; the session then keeps them itself).
pub fn top_level_uses(cell: &str) -> Vec<String> {
    with_block(cell, |parsed, _| {
        let Ok(block) = parsed else {
            return Vec::new();
        };
        block
            .stmts
            .iter()
            .filter_map(|stmt| match stmt {
                Stmt::Item(item @ syn::Item::Use(_)) => {
                    Some(quote::ToTokens::to_token_stream(item).to_string())
                }
                _ => None,
            })
            .collect()
    })
    .unwrap_or_default()
}

/// Whether `op` assigns (`+=`, `-=`, … `>>=`): its left side is changed.
pub fn is_compound_assign(op: &syn::BinOp) -> bool {
    use syn::BinOp::*;
    matches!(
        op,
        AddAssign(_)
            | SubAssign(_)
            | MulAssign(_)
            | DivAssign(_)
            | RemAssign(_)
            | BitXorAssign(_)
            | BitAndAssign(_)
            | BitOrAssign(_)
            | ShlAssign(_)
            | ShrAssign(_)
    )
}

/// Hands the Rust part of `cell`, parsed as a block, to `read`; `None` when it does not parse. The
/// parsed text starts with a line `{`: cell line `n` (0-based) is the parser's line `n + 2`.
pub fn with_parsed_block<T: Send + 'static>(
    cell: &str,
    read: impl FnOnce(&Block) -> T + Send + 'static,
) -> Option<T> {
    with_block(cell, |parsed, _| parsed.ok().map(|block| read(&block))).flatten()
}

/// Parses the Rust part of `cell` as a block (on the parsing thread, after the size limits) and
/// hands the result and the parsed text to `judge`; `None` when the cell was not parsed. The text
/// is the cell's Rust lines between a line `{` and a line `}`, so cell line `n` (0-based) is the
/// parser's line `n + 2`.
fn with_block<T: Send + 'static>(
    cell: &str,
    judge: impl FnOnce(syn::Result<Block>, &str) -> T + Send + 'static,
) -> Option<T> {
    let rust = rust_part(cell);
    if rust.len() > MAX_BYTES || rust.contains("#!") {
        return None;
    }
    // The closing brace is on a line of its own: an error there is the end of the cell.
    let text = format!("{{\n{rust}\n}}");
    if !crate::rewrite::parses_safely(&text) {
        return None;
    }
    parse_thread::run("cell-syntax", PARSER_STACK, move || {
        judge(syn::parse_str::<Block>(&text), &text)
    })
    .ok()
}

/// The cell's Rust code, with the lines that are not Rust blanked (so that line numbers stay).
fn rust_part(cell: &str) -> String {
    let code = match magics::cell_magic(cell) {
        // `%%memprofile` may stand above `%%optimize`: the body of the innermost.
        Some(mut source) => {
            while let Some(inner) = magics::cell_magic(source.body) {
                source = inner;
            }
            source.body
        }
        None => magics::split(cell).1,
    };
    let mut lines = Vec::new();
    let mut leading = true;
    for line in code.lines() {
        leading = leading && is_before_rust(line);
        lines.push(if leading { "" } else { line });
    }
    lines.join("\n")
}

/// Whether `line`, found before any line of Rust, is one evcxr takes out of the cell: a blank
/// line, a `//` comment, a `!` shell command or a `:` command (after optional spaces).
pub fn is_before_rust(line: &str) -> bool {
    line.trim().is_empty()
        || line.starts_with("//")
        || line.starts_with('!')
        || line.trim_start_matches(' ').starts_with(':')
}

/// The leading spaces of the last non-blank line of `text` (without its closing brace).
fn last_indent(text: &str) -> usize {
    let body = text.strip_suffix("\n}").unwrap_or(text);
    body.lines()
        .rev()
        .find(|line| !line.trim().is_empty())
        .map_or(0, |line| line.len() - line.trim_start().len())
}

fn tail(block: &Block) -> Tail {
    match block.stmts.last() {
        Some(Stmt::Expr(expr, None)) if always_unit(expr) => Tail::Unit,
        Some(Stmt::Expr(_, None)) => Tail::Value,
        Some(Stmt::Macro(stmt))
            if stmt.semi_token.is_none()
                && !matches!(stmt.mac.delimiter, syn::MacroDelimiter::Brace(_)) =>
        {
            if is_printing_macro(&stmt.mac) {
                Tail::Unit
            } else {
                Tail::Value
            }
        }
        _ => Tail::Statement,
    }
}

/// Expressions whose type is `()` whatever they contain.
fn always_unit(expr: &Expr) -> bool {
    match expr {
        Expr::ForLoop(_) | Expr::While(_) | Expr::Assign(_) => true,
        Expr::If(expr_if) => expr_if.else_branch.is_none(),
        Expr::Binary(binary) => matches!(
            binary.op,
            syn::BinOp::AddAssign(_)
                | syn::BinOp::SubAssign(_)
                | syn::BinOp::MulAssign(_)
                | syn::BinOp::DivAssign(_)
                | syn::BinOp::RemAssign(_)
                | syn::BinOp::BitXorAssign(_)
                | syn::BinOp::BitAndAssign(_)
                | syn::BinOp::BitOrAssign(_)
                | syn::BinOp::ShlAssign(_)
                | syn::BinOp::ShrAssign(_)
        ),
        Expr::Macro(mac) => is_printing_macro(&mac.mac),
        _ => false,
    }
}

/// `print!`, `println!`, `eprint!`, `eprintln!`: they return `()`.
fn is_printing_macro(mac: &syn::Macro) -> bool {
    mac.path.segments.last().is_some_and(|segment| {
        matches!(
            segment.ident.to_string().as_str(),
            "print" | "println" | "eprint" | "eprintln"
        )
    })
}

/// Whether `code` is one of evcxr's help commands (`:help`, `:doc NAME`) and nothing else, so
/// that its output belongs in the pager, as ipykernel's `?`.
pub fn is_help_command(code: &str) -> bool {
    let mut lines = code
        .lines()
        .filter(|line| !line.trim().is_empty() && !line.starts_with("//"));
    match (lines.next(), lines.next()) {
        (Some(line), None) => {
            // evcxr's command syntax: optional spaces, `:name`, then arguments after spaces.
            let name = line.trim_start_matches(' ').split(' ').next();
            matches!(name, Some(":help" | ":doc"))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::{is_help_command, read, top_level_uses, Syntax::*, Tail};

    #[test]
    fn top_level_uses_are_found_and_nested_ones_left() {
        let cell = ":dep foo\n// note\nuse tch::{nn, Device};\nfn f() { use std::fmt; }\n\
                    pub use std::collections::HashMap as Map;\nlet x = 1;";
        assert_eq!(
            top_level_uses(cell),
            [
                "use tch :: { nn , Device } ;",
                "pub use std :: collections :: HashMap as Map ;"
            ]
        );
        assert!(top_level_uses("let x = ;\nuse a::b;").is_empty());
    }

    #[test]
    fn cell_syntax_reads_what_the_last_statement_is() {
        assert_eq!(read("let x = 1;"), Valid(Tail::Statement));
        assert_eq!(read("let x = 1;\nx + 1"), Valid(Tail::Value));
        assert_eq!(read("format!(\"{}\", 1)"), Valid(Tail::Value));
        assert_eq!(read("println!(\"a\")"), Valid(Tail::Unit));
        assert_eq!(
            read("for i in 0..3 { println!(\"{i}\"); }"),
            Valid(Tail::Unit)
        );
        assert_eq!(read("let mut a = 1;\na += 2"), Valid(Tail::Unit));
        assert_eq!(read("if true { 1 } else { 2 }"), Valid(Tail::Value));
        assert_eq!(read("fn f() {}"), Valid(Tail::Statement));
        assert_eq!(read(""), Valid(Tail::Statement));
        assert_eq!(
            read("thread_local! { static X: u8 = 1; }"),
            Valid(Tail::Statement)
        );
    }

    #[test]
    fn cell_syntax_skips_magics_and_evcxr_commands() {
        assert_eq!(
            read(":dep rand = \"0.8\"\n// a comment\n!ls\n  :vars\nrand::random::<u8>()"),
            Valid(Tail::Value)
        );
        assert_eq!(
            read("%memprofile off\n%memhistory\nlet x = 1;"),
            Valid(Tail::Statement)
        );
        assert_eq!(
            read("%%optimize --amp bf16 --show\nlet x = 1;\nx"),
            Valid(Tail::Value)
        );
        assert_eq!(read("%%optimize --help"), Valid(Tail::Statement));
        assert_eq!(
            read("%%memprofile --steps 2\n%%optimize --checkpoint\nlet x = 1;\nx"),
            Valid(Tail::Value)
        );
        // Commands after Rust code are not commands (evcxr hands them to the compiler).
        assert_eq!(read("let x = 1;\n:vars"), Invalid);
    }

    #[test]
    fn cell_syntax_tells_unfinished_from_invalid() {
        assert_eq!(read("let x ="), Unfinished { indent: 0 });
        assert_eq!(read("fn f() {\n    let y = 1 +\n}"), Invalid);
        assert_eq!(read("let x = 1;\n    x +"), Unfinished { indent: 4 });
        assert_eq!(read("let x = 5"), Unfinished { indent: 0 });
        assert_eq!(read("#[derive(Debug)]"), Unfinished { indent: 0 });
        assert_eq!(read("let x = ;"), Invalid);
        assert_eq!(read("1 + / 2"), Invalid);
        assert_eq!(read("f(1 +)"), Invalid);
        assert_eq!(read("let = 5;"), Invalid);
        assert_eq!(read("println!(\"a\") println!(\"b\");"), Invalid);
    }

    #[test]
    fn cell_syntax_leaves_what_it_cannot_read_unjudged() {
        assert_eq!(read("#![allow(unused)]\nlet x = 1;"), Unknown);
        let deep = format!("{}{}", "(".repeat(300), ")".repeat(300));
        assert_eq!(read(&deep), Unknown);
        let long = format!("let x = {}1;", "- ".repeat(5000));
        assert_eq!(read(&long), Unknown);
    }

    #[test]
    fn help_commands_alone_in_a_cell_go_to_the_pager() {
        assert!(is_help_command(":help"));
        assert!(is_help_command("\n  :help\n"));
        assert!(is_help_command("// what is there?\n:doc Vec"));
        assert!(!is_help_command(":helpme"));
        assert!(!is_help_command(":vars"));
        assert!(!is_help_command(":help\nlet x = 1;"));
        assert!(!is_help_command("let help = 1;"));
    }
}
