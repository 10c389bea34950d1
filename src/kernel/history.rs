//! The inputs (and plain-text results) of this kernel session, for `history_request`.

use jupyter_protocol::{HistoryEntry, HistoryRequest};

/// The session number reported in history entries (one session per kernel process).
const SESSION: usize = 1;

#[derive(Default)]
/// Cells run with `store_history`, in order; cell `n` has execution count `n + 1`.
pub struct History {
    cells: Vec<(String, String)>,
}

impl History {
    /// Records a cell's input and plain-text output.
    pub fn record(&mut self, input: &str, output: &str) {
        self.cells.push((input.to_string(), output.to_string()));
    }

    /// Answers a request.
    pub fn query(&self, request: &HistoryRequest) -> Vec<HistoryEntry> {
        let numbered = self.cells.iter().enumerate().map(|(i, cell)| (i + 1, cell));
        let (selected, output): (Vec<_>, bool) = match request {
            HistoryRequest::Tail { n, output, .. } => {
                let skip = self.cells.len().saturating_sub((*n).max(0) as usize);
                (numbered.skip(skip).collect(), *output)
            }
            HistoryRequest::Range {
                start,
                stop,
                output,
                ..
            } => {
                // IPython counts from 1; stop 0 (or less) means "to the end".
                let start = (*start).max(1) as usize;
                let stop = if *stop <= 0 {
                    usize::MAX
                } else {
                    *stop as usize
                };
                (
                    numbered.filter(|(n, _)| *n >= start && *n < stop).collect(),
                    *output,
                )
            }
            HistoryRequest::Search {
                pattern,
                unique,
                output,
                n,
                ..
            } => {
                let mut found: Vec<_> = numbered
                    .filter(|(_, (input, _))| glob(pattern, input))
                    .collect();
                if *unique {
                    let mut seen = std::collections::HashSet::new();
                    found.reverse();
                    found.retain(|(_, (input, _))| seen.insert(input.clone()));
                    found.reverse();
                }
                if *n > 0 {
                    let skip = found.len().saturating_sub(*n as usize);
                    found.drain(..skip);
                }
                (found, *output)
            }
        };
        selected
            .into_iter()
            .map(|(n, (input, out))| {
                if output {
                    HistoryEntry::InputOutput(SESSION, n, (input.clone(), out.clone()))
                } else {
                    HistoryEntry::Input(SESSION, n, input.clone())
                }
            })
            .collect()
    }
}

/// Shell-style wildcard match of the whole text (`*` any run, `?` one character), as IPython's
/// history search does.
fn glob(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0, 0);
    let mut backtrack: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == '*' {
            backtrack = Some((pi, ti));
            pi += 1;
        } else if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if let Some((star, matched)) = backtrack {
            pi = star + 1;
            ti = matched + 1;
            backtrack = Some((star, matched + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(entries: Vec<HistoryEntry>) -> Vec<(usize, String)> {
        entries
            .into_iter()
            .map(|e| match e {
                HistoryEntry::Input(_, n, input) => (n, input),
                HistoryEntry::InputOutput(_, n, (input, _)) => (n, input),
            })
            .collect()
    }

    #[test]
    fn tail_range_and_search() {
        let mut history = History::default();
        for code in ["let a = 1;", "a + 1", "println!(\"x\")", "a + 1"] {
            history.record(code, "");
        }
        let tail = HistoryRequest::Tail {
            n: 2,
            output: false,
            raw: true,
        };
        assert_eq!(
            inputs(history.query(&tail)),
            vec![(3, "println!(\"x\")".into()), (4, "a + 1".into())]
        );
        let range = HistoryRequest::Range {
            session: Some(1),
            start: 2,
            stop: 3,
            output: false,
            raw: true,
        };
        assert_eq!(inputs(history.query(&range)), vec![(2, "a + 1".into())]);
        let search = HistoryRequest::Search {
            pattern: "a ?*".into(),
            unique: true,
            output: false,
            raw: true,
            n: 0,
        };
        assert_eq!(inputs(history.query(&search)), vec![(4, "a + 1".into())]);
    }

    #[test]
    fn glob_matches_whole_text() {
        assert!(glob("*", ""));
        assert!(glob("a*c", "abbbc"));
        assert!(!glob("a*c", "abcd"));
        assert!(glob("1?2*", "1+2 + 3"));
        assert!(glob("*", "*x += 1;"));
    }
}
