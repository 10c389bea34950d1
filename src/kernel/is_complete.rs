//! Answers `is_complete_request`: is this Rust cell finished, or does the user still type?
//!
//! A small lexer that knows Rust's strings, raw strings, char literals (versus lifetimes) and
//! nested comments, and tracks brackets: unclosed brackets or an unterminated string or comment
//! mean "incomplete", a closing bracket that does not match means "invalid".

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
}
