//! The batch size of a training cell: the one binding `%memfit`, `%memestimate` and
//! `%%optimize --fit` vary. It must be a `let` (or `const`) at the top level of the cell (or of
//! the one block the cell is) whose name contains "batch", bound to an integer literal:
//! `let batch_size: i64 = 16;`.
//!
//! The literal is replaced in the cell's text (not reprinted), so every other line, comment and
//! line number stays as the user wrote it.

use syn::{Expr, Item, Lit, Pat, Stmt};

use super::cell::{self, line_of};
use super::Refusal;

/// The batch-size binding found in a cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchBinding {
    /// The bound name (`batch_size`).
    pub name: String,
    /// Its value in the cell.
    pub value: u64,
    /// The 1-based line of the cell it is on.
    pub line: usize,
    /// Where the literal's digits are on that line: char columns [start, end).
    columns: (usize, usize),
    /// The literal's suffix (`i64` of `16i64`), kept when the value is replaced.
    suffix: String,
}

/// What to write in the cell, for the messages.
const HOW: &str = "bind the batch size to a name with `batch` in it, at the top level of the \
                   cell, as an integer literal (`let batch_size: i64 = 16;`), and use that name \
                   where the batch is made";

/// The batch-size binding of `src`, or a refusal that says what to write.
pub fn find(src: &str) -> Result<BatchBinding, Refusal> {
    let parsed = cell::parse(src)?;
    let mut found: Vec<BatchBinding> = Vec::new();
    let mut not_literal: Vec<(String, usize)> = Vec::new();
    // The cell's top level, or the block a cell wraps itself in (so that what it allocates is
    // freed when it ends).
    let stmts = match parsed.block.stmts.as_slice() {
        [Stmt::Expr(Expr::Block(block), _)] => &block.block.stmts,
        stmts => stmts,
    };
    for stmt in stmts {
        let (name, expr) = match stmt {
            Stmt::Local(local) => {
                let Some(init) = &local.init else { continue };
                let Some(name) = bound_name(&local.pat) else {
                    continue;
                };
                (name, &*init.expr)
            }
            Stmt::Item(Item::Const(item)) => (item.ident.to_string(), &*item.expr),
            _ => continue,
        };
        if !name.to_lowercase().contains("batch") {
            continue;
        }
        match int_literal(expr) {
            Some(binding) => found.push(BatchBinding { name, ..binding }),
            None => not_literal.push((name, line_of(syn::spanned::Spanned::span(expr)))),
        }
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(match not_literal.first() {
            Some((name, line)) => Refusal::at(
                *line,
                format!("`{name}` is not bound to an integer literal; to vary the batch, {HOW}"),
            ),
            None => Refusal::new(format!("no batch size found in the cell: {HOW}"), None),
        }),
        _ => {
            let preferred: Vec<&BatchBinding> = found
                .iter()
                .filter(|b| matches!(b.name.as_str(), "batch_size" | "batch" | "BATCH_SIZE"))
                .collect();
            if let [one] = preferred.as_slice() {
                return Ok((*one).clone());
            }
            let names: Vec<String> = found
                .iter()
                .map(|b| format!("`{}` (line {})", b.name, b.line))
                .collect();
            Err(Refusal::at(
                found[1].line,
                format!(
                    "several bindings could be the batch size: {}; name the one that is \
                     `batch_size`",
                    names.join(", ")
                ),
            ))
        }
    }
}

/// `src` with its batch size set to `value`.
#[cfg(test)]
pub fn with_batch(src: &str, value: u64) -> Result<String, Refusal> {
    let binding = find(src)?;
    Ok(replace(src, &binding, value))
}

/// `src` with `binding`'s literal replaced by `value` (same suffix).
pub fn replace(src: &str, binding: &BatchBinding, value: u64) -> String {
    let mut out = String::with_capacity(src.len() + 8);
    for (i, line) in src.split_inclusive('\n').enumerate() {
        if i + 1 != binding.line {
            out.push_str(line);
            continue;
        }
        let (start, end) = binding.columns;
        let chars: Vec<char> = line.chars().collect();
        out.extend(&chars[..start]);
        out.push_str(&format!("{value}{}", binding.suffix));
        out.extend(&chars[end.min(chars.len())..]);
    }
    out
}

/// The name a simple pattern binds (`batch`, `mut batch`, `batch: i64`).
fn bound_name(pat: &Pat) -> Option<String> {
    match pat {
        Pat::Ident(ident) => Some(ident.ident.to_string()),
        Pat::Type(typed) => bound_name(&typed.pat),
        _ => None,
    }
}

/// The binding's value, line and columns, if `expr` is an integer literal (name left empty).
fn int_literal(expr: &Expr) -> Option<BatchBinding> {
    let Expr::Lit(lit) = expr else { return None };
    let Lit::Int(int) = &lit.lit else { return None };
    let value = int.base10_parse::<u64>().ok()?;
    let span = int.span();
    let (start, end) = (span.start(), span.end());
    // One line, as integer literals are.
    (start.line == end.line).then(|| BatchBinding {
        name: String::new(),
        value,
        line: line_of(span),
        columns: (start.column, end.column),
        suffix: int.suffix().to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batch_binding_is_found_and_replaced_in_place() {
        let src = ":dep rand = \"0.8\"\nlet width = 64;\nlet batch_size: i64 = 16; // per step\n\
                   let x = Tensor::randn([batch_size, width], opts);\n";
        let binding = find(src).unwrap();
        assert_eq!(
            (binding.name.as_str(), binding.value, binding.line),
            ("batch_size", 16, 3)
        );
        let replaced = with_batch(src, 48).unwrap();
        assert_eq!(
            replaced,
            src.replace("batch_size: i64 = 16;", "batch_size: i64 = 48;")
        );
        // Suffixes and consts.
        let src = "const BATCH: i64 = 8_i64;\nlet n = 2;";
        assert_eq!(
            with_batch(src, 100).unwrap(),
            "const BATCH: i64 = 100i64;\nlet n = 2;"
        );
        // Non-ASCII text before the literal on its line.
        let src = "let é_batch = 4; // é\n";
        assert_eq!(with_batch(src, 5).unwrap(), "let é_batch = 5; // é\n");
    }

    #[test]
    fn a_missing_or_ambiguous_batch_binding_says_what_to_write() {
        let none = find("let x = 1;\nfor i in 0..3 {}").unwrap_err();
        assert!(none.message.contains("let batch_size: i64 = 16;"), "{none}");
        let computed = find("let width = 8;\nlet batch = width * 2;").unwrap_err();
        assert_eq!(computed.line, Some(2));
        assert!(computed
            .message
            .contains("`batch` is not bound to an integer literal"));
        let two = find("let train_batch = 4;\nlet eval_batch = 8;").unwrap_err();
        assert!(two.message.contains("`train_batch` (line 1)"), "{two}");
        // The conventional name wins over others.
        let binding = find("let batch_size = 32;\nlet batches = 10;").unwrap();
        assert_eq!(binding.name, "batch_size");
        // Nested bindings are not the cell's batch size, but a cell wrapped in a block is read
        // inside it.
        assert!(find("fn f() { let batch = 3; }").is_err());
        assert!(find("let x = 1;\n{ let batch = 3; }").is_err());
        let src = "{\n    let batch: i64 = 3;\n    run(batch);\n}\n";
        assert_eq!(with_batch(src, 7).unwrap(), src.replace("= 3", "= 7"));
    }
}
