//! What a rewrite changed, as the reader sees it: one line per change, tied to the cell lines it
//! touched so that the list reads top to bottom like the cell.

use std::fmt;

/// One change a rewrite made (or chose not to make), with the cell lines it concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// First and last cell line (1-based) the change touched; `None` for a change to the cell as
    /// a whole (a note, a skipped rewrite).
    pub lines: Option<(usize, usize)>,
    /// What changed and why, in a sentence.
    pub what: String,
}

impl Change {
    /// A change at one cell line.
    pub fn at(line: usize, what: impl Into<String>) -> Change {
        Change::over((line, line), what)
    }

    /// A change over the cell lines `first..=last`.
    pub fn over((first, last): (usize, usize), what: impl Into<String>) -> Change {
        Change {
            lines: Some((first, last)),
            what: what.into(),
        }
    }

    /// A change to the cell as a whole.
    pub fn general(what: impl Into<String>) -> Change {
        Change {
            lines: None,
            what: what.into(),
        }
    }
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.lines {
            Some((first, last)) if first == last => write!(f, "line {first}: {}", self.what),
            Some((first, last)) => write!(f, "lines {first}–{last}: {}", self.what),
            None => f.write_str(&self.what),
        }
    }
}

/// Orders changes by the first cell line they touch (the rewrites run in their own order, the
/// reader reads top to bottom); changes to the whole cell come last, in the order they were made.
pub fn in_line_order(changes: &mut [Change]) {
    changes.sort_by_key(|change| change.lines.map_or(usize::MAX, |(first, _)| first));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_read_as_lines_and_sort_by_their_first_line() {
        let mut changes = vec![
            Change::general("note"),
            Change::over((9, 11), "b"),
            Change::at(2, "a"),
        ];
        in_line_order(&mut changes);
        let text: Vec<String> = changes.iter().map(ToString::to_string).collect();
        assert_eq!(text, ["line 2: a", "lines 9–11: b", "note"]);
    }
}
