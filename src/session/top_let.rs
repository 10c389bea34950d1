//! A cell's top-level `let name = value;` (one name, no type written), as byte offsets: where a
//! type goes and where the value is, for the rewrites that keep a variable evcxr cannot
//! (`opaque`, `closures`).

use proc_macro2::LineColumn;
use syn::spanned::Spanned;
use syn::{Expr, Pat, Stmt};

/// Where a top-level `let` of one name is, and positions inside its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopLet {
    /// Just after the pattern: where the `let`'s type goes.
    pub pattern_end: usize,
    /// Where the value starts and ends.
    pub value: (usize, usize),
    /// The positions `marks` read from the value (`None` where it read none).
    pub marks: Vec<Option<usize>>,
}

/// Positions inside a `let`'s value; `None` when the value is not of the kind looked for.
pub type Marks = fn(&Expr) -> Option<Vec<Option<LineColumn>>>;

/// The top-level `let variable = …;` of `code` whose value `marks` accepts, or `None` when
/// there is no such `let`.
pub fn find(code: &str, variable: &str, marks: Marks) -> Option<TopLet> {
    let found = spans(code, marks)?
        .into_iter()
        .find(|spans| spans.name == variable)?;
    placed(code, found)
}

/// Every top-level `let name = …;` of `code` (one name, no type written) whose value `marks`
/// accepts, with its name, in the cell's order; `None` when the cell does not parse or a
/// position is outside the cell.
pub fn all(code: &str, marks: Marks) -> Option<Vec<(String, TopLet)>> {
    spans(code, marks)?
        .into_iter()
        .map(|spans| Some((spans.name.clone(), placed(code, spans)?)))
        .collect()
}

/// A top-level `let` as the parser placed it.
struct Spans {
    name: String,
    pattern_end: LineColumn,
    value: (LineColumn, LineColumn),
    marks: Vec<Option<LineColumn>>,
}

/// The top-level `let`s (one name each) whose value `marks` accepts, as the parser placed them.
fn spans(code: &str, marks: Marks) -> Option<Vec<Spans>> {
    crate::cell_syntax::with_parsed_block(code, move |block| {
        block
            .stmts
            .iter()
            .filter_map(|stmt| {
                let Stmt::Local(local) = stmt else {
                    return None;
                };
                let Pat::Ident(ident) = &local.pat else {
                    return None;
                };
                let init = local.init.as_ref().filter(|init| init.diverge.is_none())?;
                if ident.subpat.is_some() {
                    return None;
                }
                Some(Spans {
                    name: ident.ident.to_string(),
                    pattern_end: local.pat.span().end(),
                    value: (init.expr.span().start(), init.expr.span().end()),
                    marks: marks(&init.expr)?,
                })
            })
            .collect()
    })
}

/// `spans` as byte offsets into `code`; `None` when one is outside the cell.
fn placed(code: &str, spans: Spans) -> Option<TopLet> {
    let offset = |at| super::positions::offset_in_block(code, at);
    Some(TopLet {
        pattern_end: offset(spans.pattern_end)?,
        value: (offset(spans.value.0)?, offset(spans.value.1)?),
        // A mark outside the cell drops the whole.
        marks: spans
            .marks
            .into_iter()
            .map(|at| match at {
                None => Some(None),
                Some(at) => offset(at).map(Some),
            })
            .collect::<Option<_>>()?,
    })
}

/// For any value: no marks.
pub fn any_value(_: &Expr) -> Option<Vec<Option<LineColumn>>> {
    Some(Vec::new())
}
