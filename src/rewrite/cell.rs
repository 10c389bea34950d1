//! Parsing a cell's source into a syn block, and printing a rewritten block back.
//!
//! Printing keeps the original text (and comments) of every top-level statement the rewrite did
//! not change; changed statements are printed by prettyplease, which drops comments, and the
//! header says so when that lost any.

use proc_macro2::Span;
use quote::ToTokens;
use syn::spanned::Spanned;
use syn::{Block, Stmt};

use super::syntax::COMMENT_MACRO;
use super::Refusal;

/// The deepest bracket nesting accepted: far beyond real code, well within the parser's stack.
const MAX_NESTING: usize = 256;

/// Cells larger than this are refused rather than parsed.
const MAX_BYTES: usize = 1 << 20;

/// A parsed cell.
pub(crate) struct Cell {
    /// Leading evcxr commands (`:dep …`), kept verbatim at the top.
    commands: Vec<String>,
    /// The text that was parsed: the Rust part of the cell inside `{\n` … `\n}`.
    text: String,
    /// The cell's statements.
    pub block: Block,
}

/// The 1-based line in the cell of a span in the parsed text (which starts with `{\n`).
pub(crate) fn line_of(span: Span) -> usize {
    span.start().line.saturating_sub(1).max(1)
}

/// Parses a cell: leading evcxr `:` commands, then Rust statements and items.
pub(crate) fn parse(src: &str) -> Result<Cell, Refusal> {
    if src.len() > MAX_BYTES {
        return Err(Refusal::new(
            format!(
                "the cell is {} bytes; %%optimize reads cells up to {MAX_BYTES} bytes",
                src.len()
            ),
            None,
        ));
    }
    let mut commands = Vec::new();
    let mut rust = Vec::new();
    let mut leading = true;
    for line in src.lines() {
        let trimmed = line.trim_start();
        let is_command =
            trimmed.starts_with(':') && trimmed[1..].starts_with(|c: char| c.is_ascii_alphabetic());
        if leading && is_command {
            // Blanked, not removed, so that line numbers stay the cell's.
            commands.push(line.to_string());
            rust.push("");
            continue;
        }
        leading &= trimmed.is_empty();
        rust.push(line);
    }
    let text = format!("{{\n{}\n}}", rust.join("\n"));
    if let Some(line) = too_deep(&text) {
        return Err(Refusal::at(
            line.saturating_sub(1).max(1),
            format!("brackets nest more than {MAX_NESTING} deep; %%optimize does not read this"),
        ));
    }
    if let Some(line) = too_long(&text) {
        return Err(Refusal::at(
            line.saturating_sub(1).max(1),
            format!(
                "an expression here runs over {MAX_RUN} tokens without a `;` or `,`; \
                 %%optimize does not read this"
            ),
        ));
    }
    let block = syn::parse_str::<Block>(&text).map_err(|error| {
        let lines = src.lines().count().max(1);
        Refusal::at(
            line_of(error.span()).min(lines),
            format!("%%optimize could not read the cell as Rust: {error}"),
        )
    })?;
    Ok(Cell {
        commands,
        text,
        block,
    })
}

/// Whether syn can parse `text` without risk to the stack: brackets nest at most
/// [`MAX_NESTING`] deep and no run of tokens is longer than [`MAX_RUN`].
pub(crate) fn parses_safely(text: &str) -> bool {
    too_deep(text).is_none() && too_long(text).is_none()
}

/// The line where bracket nesting first goes past [`MAX_NESTING`] (1-based, in `text`).
fn too_deep(text: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut line = 1;
    for c in text.chars() {
        match c {
            '(' | '[' | '{' => {
                depth += 1;
                if depth > MAX_NESTING {
                    return Some(line);
                }
            }
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            '\n' => line += 1,
            _ => {}
        }
    }
    None
}

/// The most tokens accepted between two `;` or `,` at one nesting level: far beyond real code.
/// Longer runs (`a + a + …`, `- - - … x`) parse into trees as deep as they are long, and the
/// parser, the visitors and the printer recurse once per level.
const MAX_RUN: usize = 4096;

/// The line where a run of tokens first goes past [`MAX_RUN`] (1-based, in `text`).
fn too_long(text: &str) -> Option<usize> {
    fn walk(tokens: proc_macro2::TokenStream) -> Option<usize> {
        let mut run = 0;
        for tree in tokens {
            match &tree {
                proc_macro2::TokenTree::Punct(p) if matches!(p.as_char(), ';' | ',') => run = 0,
                proc_macro2::TokenTree::Group(group) => {
                    if let Some(line) = walk(group.stream()) {
                        return Some(line);
                    }
                    run += 1;
                }
                _ => run += 1,
            }
            if run > MAX_RUN {
                return Some(tree.span().start().line);
            }
        }
        None
    }
    // Unbalanced delimiters do not lex: the parser reports those.
    walk(text.parse().ok()?)
}

/// Prints `block` (the rewritten cell), keeping the original text of unchanged top-level
/// statements, under a comment header.
pub(crate) fn print(cell: &Cell, block: &Block, header: &str) -> String {
    let originals = cell.originals();
    let keys: Vec<String> = block.stmts.iter().map(key).collect();
    let mut out = Printer::default();
    let mut next = 0; // the next original statement not yet accounted for
    for (i, stmt) in block.stmts.iter().enumerate() {
        if is_comment_marker(stmt) {
            // Printed with the statement it comments on.
            out.markers.push(pretty(stmt));
            continue;
        }
        let Some(original) = originals.get(next) else {
            out.inserted(&pretty(stmt));
            continue;
        };
        if original.key == keys[i] {
            out.verbatim(original);
            next += 1;
        } else if keys[i + 1..].contains(&original.key) {
            // Inserted by the rewrite before an unchanged statement.
            out.inserted(&pretty(stmt));
        } else if let Some(ahead) = originals[next..].iter().position(|o| o.key == keys[i]) {
            // The rewrite removed statements: their comments go with them.
            for removed in &originals[next..next + ahead] {
                out.removed(removed);
            }
            out.verbatim(&originals[next + ahead]);
            next += ahead + 1;
        } else {
            out.changed(original, &pretty(stmt));
            next += 1;
        }
    }
    for removed in originals.iter().skip(next) {
        out.removed(removed);
    }
    let markers = std::mem::take(&mut out.markers);
    for marker in markers {
        out.inserted(&marker);
    }
    out.body.push_str(&cell.tail());

    let mut text = format!("// {header}\n");
    if !out.lost_comments.is_empty() {
        let lines: Vec<String> = out.lost_comments.iter().map(|l| l.to_string()).collect();
        text.push_str(&format!(
            "// Comments inside the rewritten statements (at line{} {} of the cell) were \
             dropped: the printer cannot keep them.\n",
            if lines.len() == 1 { "" } else { "s" },
            lines.join(", ")
        ));
    }
    for command in &cell.commands {
        text.push_str(command);
        text.push('\n');
    }
    text.push_str(out.body.trim_start_matches(['\n', '\r']).trim_end());
    text.push('\n');
    text
}

/// Assembles the printed body.
#[derive(Default)]
struct Printer {
    body: String,
    /// Comments waiting for the next statement.
    markers: Vec<String>,
    /// Lines of original statements whose comments could not be kept.
    lost_comments: Vec<usize>,
}

impl Printer {
    fn new_line(&mut self) {
        if !self.body.is_empty() && !self.body.ends_with('\n') {
            self.body.push('\n');
        }
    }

    /// The comments waiting for the statement about to be printed.
    fn flush_markers(&mut self) {
        if !self.markers.is_empty() {
            let trimmed = self.body.trim_end_matches([' ', '\t']).len();
            self.body.truncate(trimmed);
            self.new_line();
            for marker in std::mem::take(&mut self.markers) {
                self.body.push_str(&marker);
                self.body.push('\n');
            }
        }
    }

    fn verbatim(&mut self, original: &Original) {
        self.body.push_str(&original.leading);
        self.flush_markers();
        self.body.push_str(&original.text);
        self.body.push_str(&original.trailing);
    }

    fn inserted(&mut self, printed: &str) {
        self.new_line();
        self.flush_markers();
        self.body.push_str(printed);
        self.body.push('\n');
    }

    /// A statement the rewrite changed: the comments before and after it stay, those inside
    /// are lost.
    fn changed(&mut self, original: &Original, printed: &str) {
        self.body
            .push_str(original.leading.trim_end_matches([' ', '\t']));
        self.new_line();
        self.flush_markers();
        self.body.push_str(printed);
        self.body.push_str(&original.trailing);
        if has_comment(&original.text) {
            self.lost_comments.push(original.line);
        }
    }

    fn removed(&mut self, original: &Original) {
        if [&original.leading, &original.text, &original.trailing]
            .iter()
            .any(|text| has_comment(text))
        {
            self.lost_comments.push(original.line);
        }
    }
}

/// Whether a statement is a comment marker ([`COMMENT_MACRO`]).
fn is_comment_marker(stmt: &Stmt) -> bool {
    matches!(stmt, Stmt::Macro(m) if m.mac.path.is_ident(COMMENT_MACRO))
}

/// A top-level statement of the original cell, as text.
struct Original {
    /// Whole lines of whitespace and comments before it.
    leading: String,
    /// The statement's own text.
    text: String,
    /// The rest of its last line (a trailing comment), with the line break.
    trailing: String,
    /// Its tokens, to recognise it unchanged.
    key: String,
    /// Its 1-based line in the cell.
    line: usize,
}

impl Cell {
    /// The text the cell has at `span` (a statement's own text, as the user wrote it).
    pub(crate) fn text_at(&self, span: Span) -> &str {
        self.text.get(span.byte_range()).unwrap_or("")
    }

    fn originals(&self) -> Vec<Original> {
        let mut previous_end = 2; // after "{\n"
        let mut originals: Vec<Original> = Vec::new();
        for stmt in &self.block.stmts {
            let range = stmt.span().byte_range();
            let (start, end) = (range.start.max(previous_end), range.end.max(previous_end));
            let gap = self.text.get(previous_end..start).unwrap_or("");
            let (trailing, leading) = split_gap(gap, originals.is_empty());
            if let Some(previous) = originals.last_mut() {
                previous.trailing = trailing.to_string();
            }
            originals.push(Original {
                leading: leading.to_string(),
                text: self.text.get(start..end).unwrap_or("").to_string(),
                trailing: String::new(),
                key: key(stmt),
                line: line_of(stmt.span()),
            });
            previous_end = end;
        }
        // The last statement's trailing text is part of the tail.
        originals
    }

    /// The text after the last statement (its trailing comment and any comments after it),
    /// without the closing "\n}".
    fn tail(&self) -> String {
        let start = self
            .block
            .stmts
            .last()
            .map_or(2, |stmt| stmt.span().byte_range().end);
        let end = self.text.len().saturating_sub(2);
        self.text.get(start..end).unwrap_or("").to_string()
    }
}

/// Splits the text between two statements into the rest of the first one's line (with its line
/// break) and the whole lines before the second one.
fn split_gap(gap: &str, first: bool) -> (&str, &str) {
    if first {
        return ("", gap);
    }
    match gap.find('\n') {
        // A block comment may go on past the line: keep it whole.
        Some(newline) if gap[..newline].contains("/*") => ("", gap),
        Some(newline) => gap.split_at(newline + 1),
        None => (gap, ""),
    }
}

/// A statement's tokens as a string: equal keys mean an unchanged statement.
fn key(stmt: &Stmt) -> String {
    stmt.to_token_stream().to_string()
}

/// A statement printed by prettyplease, with comment markers turned into comments.
pub(crate) fn pretty(stmt: &Stmt) -> String {
    let function: syn::ItemFn = syn::ItemFn {
        attrs: Vec::new(),
        vis: syn::Visibility::Inherited,
        sig: syn::parse_quote!(fn tchmem_cell()),
        block: Box::new(Block {
            brace_token: Default::default(),
            stmts: vec![stmt.clone()],
        }),
    };
    let file = syn::File {
        shebang: None,
        attrs: Vec::new(),
        items: vec![syn::Item::Fn(function)],
    };
    let printed = prettyplease::unparse(&file);
    let lines: Vec<&str> = printed.lines().collect();
    // The body is everything between `fn tchmem_cell() {` and the last `}`.
    let body = match lines.len() {
        n if n >= 3 => &lines[1..n - 1],
        _ => &lines[..0],
    };
    // Dedenting would change a multi-line string literal's text: such a statement keeps the
    // printer's indentation.
    let dedent = !has_multiline_literal(stmt);
    let mut out = String::new();
    for line in body {
        let line = match dedent {
            true => line.strip_prefix("    ").unwrap_or(line),
            false => line,
        };
        out.push_str(line);
        out.push('\n');
    }
    markers_to_comments(out.trim_end())
}

fn has_multiline_literal(stmt: &Stmt) -> bool {
    let mut found = false;
    super::syntax::walk_tokens(stmt.to_token_stream(), &mut |tree| {
        if let proc_macro2::TokenTree::Literal(literal) = tree {
            found |= literal.to_string().contains('\n');
        }
    });
    found
}

/// Width to wrap generated comments at.
const COMMENT_WIDTH: usize = 96;

/// `__tchmem_comment!("text");` (on one line or spread over several by the printer) →
/// `// text`, wrapped, at the marker's indentation.
fn markers_to_comments(text: &str) -> String {
    let marker = format!("{COMMENT_MACRO}!(");
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(&marker) {
        let (before, from_marker) = rest.split_at(at);
        let indent = &before[before.rfind('\n').map_or(0, |n| n + 1)..];
        let after_paren = &from_marker[marker.len()..];
        let Some(end) = after_paren.find(");") else {
            break;
        };
        let Ok(literal) = syn::parse_str::<syn::LitStr>(after_paren[..end].trim()) else {
            break;
        };
        out.push_str(before);
        let width = COMMENT_WIDTH.saturating_sub(indent.len() + 3).max(20);
        let mut line = String::new();
        let mut first = true;
        for word in literal.value().split_whitespace() {
            if !line.is_empty() && line.len() + 1 + word.len() > width {
                if !first {
                    out.push_str(indent);
                }
                out.push_str(&format!("// {line}\n"));
                first = false;
                line.clear();
            }
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(word);
        }
        if !first {
            out.push_str(indent);
        }
        out.push_str(&format!("// {line}"));
        rest = &after_paren[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Whether `text` holds a comment other than a doc comment (which syn keeps), ignoring string
/// and character literals.
pub(crate) fn has_comment(text: &str) -> bool {
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '/' if chars.get(i + 1) == Some(&'/') => {
                let doc = chars.get(i + 2) == Some(&'/') && chars.get(i + 3) != Some(&'/');
                let inner_doc = chars.get(i + 2) == Some(&'!');
                if !doc && !inner_doc {
                    return true;
                }
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '/' if chars.get(i + 1) == Some(&'*') => {
                let doc = matches!(chars.get(i + 2), Some('*') | Some('!'))
                    && chars.get(i + 3) != Some(&'/');
                if !doc {
                    return true;
                }
                i += 2;
                while i + 1 < chars.len() && !(chars[i] == '*' && chars[i + 1] == '/') {
                    i += 1;
                }
                i += 2;
            }
            'r' if matches!(chars.get(i + 1), Some('#') | Some('"'))
                && !chars[..i]
                    .last()
                    .is_some_and(|c| c.is_alphanumeric() || *c == '_') =>
            {
                // A raw string: r"…" or r#"…"#.
                let mut j = i + 1;
                let mut hashes = 0;
                while chars.get(j) == Some(&'#') {
                    hashes += 1;
                    j += 1;
                }
                if chars.get(j) != Some(&'"') {
                    i += 1;
                    continue;
                }
                j += 1;
                loop {
                    match chars.get(j) {
                        None => return false,
                        Some('"') if (1..=hashes).all(|h| chars.get(j + h) == Some(&'#')) => {
                            i = j + hashes + 1;
                            break;
                        }
                        _ => j += 1,
                    }
                }
            }
            '"' => {
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            '\'' => {
                // A char literal ('a', '\n', '\u{1F600}') or a lifetime ('a).
                if chars.get(i + 1) == Some(&'\\') {
                    i += 2;
                    while i < chars.len() && chars[i] != '\'' {
                        i += 1;
                    }
                    i += 1;
                } else if chars.get(i + 2) == Some(&'\'') {
                    i += 3;
                } else {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrite_cell_comments_are_found_outside_literals() {
        assert!(has_comment("let x = 1; // one"));
        assert!(has_comment("let x = /* one */ 1;"));
        assert!(!has_comment("let s = \"// not a comment\";"));
        assert!(!has_comment("let s = r#\"/* no \"# ;"));
        assert!(!has_comment("/// a doc comment\nfn f() {}"));
        assert!(!has_comment("let c = '\"'; let d = '/';"));
        assert!(has_comment("fn f<'a>(x: &'a str) {} // yes"));
    }

    #[test]
    fn rewrite_cell_parse_keeps_lines_and_commands() {
        let cell = parse(":dep rand = \"0.8\"\nlet x = 1;\nlet y = x + 1;\n").unwrap();
        assert_eq!(cell.commands, vec![":dep rand = \"0.8\"".to_string()]);
        assert_eq!(line_of(cell.block.stmts[1].span()), 3);
        let err = parse("let x = 1;\nlet y = ;\n").err().unwrap();
        assert_eq!(err.line, Some(2), "{err}");
        let deep = format!("let x = {}1{};", "(".repeat(300), ")".repeat(300));
        assert!(parse(&deep).is_err());
    }

    #[test]
    fn rewrite_cell_print_keeps_unchanged_statements_verbatim() {
        let src = "// setup\nlet   x = 1; // one\n\nlet y = 2;\n// the end\n";
        let cell = parse(src).unwrap();
        let mut block = cell.block.clone();
        block.stmts[1] = syn::parse_quote!(let y = 3;);
        let marker: Stmt = syn::parse_quote!(__tchmem_comment!("a note"););
        block.stmts.insert(1, marker);
        let out = print(&cell, &block, "header");
        assert_eq!(
            out,
            "// header\n// setup\nlet   x = 1; // one\n\n// a note\nlet y = 3;\n// the end\n"
        );
    }
}
