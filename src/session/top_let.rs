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
    let name = variable.to_string();
    type Spans = (
        LineColumn,
        (LineColumn, LineColumn),
        Vec<Option<LineColumn>>,
    );
    let spans: Spans = crate::cell_syntax::with_parsed_block(code, move |block| {
        block.stmts.iter().find_map(|stmt| {
            let Stmt::Local(local) = stmt else {
                return None;
            };
            let Pat::Ident(ident) = &local.pat else {
                return None;
            };
            let init = local.init.as_ref().filter(|init| init.diverge.is_none())?;
            if ident.ident != name || ident.subpat.is_some() {
                return None;
            }
            Some((
                local.pat.span().end(),
                (init.expr.span().start(), init.expr.span().end()),
                marks(&init.expr)?,
            ))
        })
    })??;
    let offset = |at| super::positions::offset_in_block(code, at);
    Some(TopLet {
        pattern_end: offset(spans.0)?,
        value: (offset(spans.1 .0)?, offset(spans.1 .1)?),
        // A mark outside the cell drops the whole.
        marks: spans
            .2
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
