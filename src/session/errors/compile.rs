//! Compile errors shown against the cell's own lines: the error, where it is (cell line and
//! column, counted in characters as the user sees them), the line with the spot underlined, and
//! the compiler's notes.
//!
//! evcxr's own report (`CompilationError::build_report`) gives up on any cell that is not ASCII
//! (it adds character columns to byte offsets), and heads every report with the cell's first
//! line. Here the spans evcxr maps into the cell are read as they are (1-based lines, 1-based
//! character columns) and drawn by [`render`], a pure function of the cell and a [`Diagnostic`],
//! so any cell renders and the tests need no compiler.

use evcxr::CompilationError;
use serde_json::Value;
use unicode_width::UnicodeWidthChar;

/// A part of the cell: 1-based lines, 1-based columns counted in characters, the end exclusive
/// (evcxr's `Span`, which it maps rustc's spans in the generated crate to).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CellSpan {
    /// (line, column) of the first character.
    pub start: (usize, usize),
    /// (line, column) just after the last character.
    pub end: (usize, usize),
}

/// Text the compiler attached to a part of the cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Label {
    pub span: CellSpan,
    pub text: String,
    /// The spot the error is about (rustc's primary span); the location line names it.
    pub primary: bool,
}

/// One compile error, reduced to what the report shows.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Diagnostic {
    /// `error` or `warning`.
    pub level: String,
    /// rustc's code, as `E0425`.
    pub code: Option<String>,
    pub message: String,
    /// Parts of the cell; empty when the compiler pointed only at code generated around the cell.
    pub labels: Vec<Label>,
    /// Notes and help without a place in the cell.
    pub notes: Vec<String>,
}

/// Reads an evcxr error: its labels in the cell, and every note or help that has no place there.
pub fn diagnostic(error: &CompilationError) -> Diagnostic {
    let level = match error.level() {
        "" => "error".to_string(),
        level => level.to_string(),
    };
    let message = error.message();
    let mut labels = Vec::new();
    let mut notes = Vec::new();
    // The message again, as evcxr labels a span that has no label of its own.
    let restated = format!("{level}: {message}");
    for (spanned, helps) in error
        .spanned_messages()
        .iter()
        .map(|m| (m, false))
        .chain(error.help_spanned().iter().map(|m| (m, true)))
    {
        let text = tidy(&spanned.label);
        match spanned.span {
            Some(span) => labels.push(Label {
                span: CellSpan {
                    start: (span.start_line, span.start_column),
                    end: (span.end_line, span.end_column),
                },
                text: if text == restated {
                    String::new()
                } else {
                    text
                },
                primary: spanned.is_primary && !helps,
            }),
            None if !text.is_empty() && text != restated => notes.push(text),
            None => {}
        }
    }
    if !labels.is_empty() && !labels.iter().any(|label| label.primary) {
        labels[0].primary = true;
    }
    // evcxr keeps a child's message only when the child has exactly one span (or is an error).
    if let Value::Array(children) = &error.json["children"] {
        for child in children {
            let spans = child["spans"].as_array().map_or(0, Vec::len);
            let child_level = child["level"].as_str().unwrap_or("note");
            if spans == 0 || (spans > 1 && child_level != "error") {
                if let Some(text) = child["message"].as_str() {
                    notes.push(tidy(&format!("{child_level}: {text}")));
                }
            }
        }
    }
    notes.extend(hint(error.code()).map(str::to_string));
    notes.extend(error.evcxr_extra_hint().map(str::to_string));
    notes.dedup();
    Diagnostic {
        level,
        code: error.code().map(str::to_string),
        message,
        labels,
        notes,
    }
}

/// What to do about errors that come from how cells keep variables.
fn hint(code: Option<&str>) -> Option<&'static str> {
    match code? {
        "E0384" | "E0596" => Some(
            "help: a variable from an earlier cell can be made mutable by binding it again: \
             `let mut x = x;`",
        ),
        _ => None,
    }
}

/// evcxr stores variables after the cell's code; "found `evcxr_variable_store`" means the cell
/// ended there (evcxr rewrites this in the message, not in labels and notes).
fn tidy(text: &str) -> String {
    text.replace("`evcxr_variable_store`", "<end of input>")
}

/// How the report is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// Text only (what the tests read).
    #[cfg_attr(not(test), allow(dead_code))]
    Plain,
    /// ANSI colours, which Jupyter front ends show in tracebacks.
    Ansi,
}

impl Style {
    fn paint(self, text: &str, ansi: &str) -> String {
        match self {
            Style::Plain => text.to_string(),
            Style::Ansi => format!("\x1b[{ansi}m{text}\x1b[0m"),
        }
    }
}

const RED: &str = "1;31";
const BLUE: &str = "1;34";
const BOLD: &str = "1";

/// The report of one error against the cell `code`: a header (level, code, message), a location
/// line (`--> cell line L, column C`, the primary label's start), each line of the cell a label
/// touches with the label's characters underlined, then the notes.
pub fn render(diagnostic: &Diagnostic, code: &str, style: Style) -> String {
    let lines: Vec<&str> = code
        .split('\n')
        .map(|line| line.strip_suffix('\r').unwrap_or(line))
        .collect();
    let labels: Vec<Label> = diagnostic
        .labels
        .iter()
        .map(|label| Label {
            span: clamp(label.span, &lines),
            ..label.clone()
        })
        .collect();
    let mut shown: Vec<usize> = labels
        .iter()
        .flat_map(|label| [label.span.start.0, label.span.end.0])
        .collect();
    shown.sort_unstable();
    shown.dedup();
    let gutter = shown.last().map_or(1, |line| line.to_string().len());
    let margin = |mark: &str| style.paint(&format!("{:gutter$} {mark}", ""), BLUE);

    let mut out = Vec::new();
    let code_part = diagnostic
        .code
        .as_ref()
        .map_or(String::new(), |code| format!("[{code}]"));
    let level_colour = if diagnostic.level == "error" {
        RED
    } else {
        "1;33"
    };
    out.push(format!(
        "{}{}",
        style.paint(&format!("{}{code_part}", diagnostic.level), level_colour),
        style.paint(&format!(": {}", diagnostic.message), BOLD)
    ));
    let primary = labels.iter().find(|label| label.primary).or(labels.first());
    match primary {
        Some(label) => out.push(format!(
            "{}cell line {}, column {}",
            style.paint(&format!("{:gutter$}--> ", ""), BLUE),
            label.span.start.0,
            label.span.start.1
        )),
        None => out.push(format!(
            "{}not in a line of the cell: the compiler reports it in code generated around the cell",
            style.paint(&format!("{:gutter$}--> ", ""), BLUE),
        )),
    }
    if !labels.is_empty() {
        out.push(margin("|"));
    }
    for (index, &number) in shown.iter().enumerate() {
        if index > 0 && shown[index - 1] + 1 != number {
            out.push(style.paint("...", BLUE));
        }
        let line = lines[number - 1];
        out.push(format!(
            "{} {}",
            style.paint(&format!("{number:>gutter$} |"), BLUE),
            display(line)
        ));
        let mut marks: Vec<(usize, usize, &Label, bool)> = labels
            .iter()
            .filter_map(|label| {
                underline(label, number, line).map(|(from, to, last)| (from, to, label, last))
            })
            .collect();
        marks.sort_by_key(|&(from, _, label, _)| (from, !label.primary));
        for (from, to, label, last) in marks {
            let (mark, colour) = if label.primary {
                ("^", RED)
            } else {
                ("-", BLUE)
            };
            let text = if last && !label.text.is_empty() {
                format!(" {}", label.text)
            } else {
                String::new()
            };
            out.push(format!(
                "{} {}{}",
                margin("|"),
                " ".repeat(from),
                style.paint(
                    &format!("{}{text}", mark.repeat((to - from).max(1))),
                    colour
                )
            ));
        }
    }
    for note in &diagnostic.notes {
        let mut note_lines = note.lines();
        out.push(format!(
            "{} {}",
            margin("="),
            note_lines.next().unwrap_or_default()
        ));
        for more in note_lines {
            out.push(format!("{:gutter$}   {more}", ""));
        }
    }
    out.join("\n")
}

/// Keeps a span inside the cell (a span at the end of input may point one past it).
fn clamp(span: CellSpan, lines: &[&str]) -> CellSpan {
    let point = |(line, column): (usize, usize)| {
        let line = line.clamp(1, lines.len());
        let length = lines[line - 1].chars().count();
        (line, column.clamp(1, length + 1))
    };
    let (start, end) = (point(span.start), point(span.end));
    CellSpan {
        start,
        end: end.max(start),
    }
}

/// The display columns a label underlines on cell line `number`, and whether it ends there (its
/// text goes with its last line). A label over several lines marks the rest of its first line
/// and its last line up to its end.
fn underline(label: &Label, number: usize, line: &str) -> Option<(usize, usize, bool)> {
    let CellSpan { start, end } = label.span;
    if number != start.0 && number != end.0 {
        return None;
    }
    let length = line.chars().count() + 1;
    let from = if number == start.0 {
        start.1
    } else {
        1 + line.chars().take_while(|c| c.is_whitespace()).count()
    };
    let to = if number == end.0 { end.1 } else { length };
    let from = width(line, from - 1);
    let to = width(line, to - 1).max(from + 1);
    Some((from, to, number == end.0))
}

/// How a character of the cell is shown: tabs as four spaces, control characters and line
/// separators (which would break the report's lines) as U+FFFD.
fn shown(c: char) -> (char, usize) {
    match c {
        '\t' => (' ', 4),
        c if c.is_control() || c == '\u{2028}' || c == '\u{2029}' => ('\u{FFFD}', 1),
        c => (c, c.width().unwrap_or(0)),
    }
}

/// The display width of the first `chars` characters of `line` (wide CJK characters take two
/// columns), so underlines sit under the right characters.
fn width(line: &str, chars: usize) -> usize {
    line.chars().take(chars).map(|c| shown(c).1).sum()
}

fn display(line: &str) -> String {
    line.chars()
        .map(|c| match shown(c) {
            (' ', 4) => "    ".to_string(),
            (c, _) => c.to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(start: (usize, usize), end: (usize, usize)) -> CellSpan {
        CellSpan { start, end }
    }

    fn error(code: &str, message: &str, labels: Vec<Label>) -> Diagnostic {
        Diagnostic {
            level: "error".into(),
            code: Some(code.into()),
            message: message.into(),
            labels,
            notes: Vec::new(),
        }
    }

    /// rustc's error for an undefined `y` at a cell line and character column.
    fn undefined_y(line: usize, column: usize) -> Diagnostic {
        error(
            "E0425",
            "cannot find value `y` in this scope",
            vec![label(
                span((line, column), (line, column + 1)),
                "not found in this scope",
                true,
            )],
        )
    }

    fn label(span: CellSpan, text: &str, primary: bool) -> Label {
        Label {
            span,
            text: text.into(),
            primary,
        }
    }

    /// The display column where `marker` starts on a rendered line.
    fn column_of(rendered_line: &str, marker: char) -> usize {
        let at = rendered_line.find(marker).unwrap();
        rendered_line[..at].chars().map(|c| shown(c).1).sum()
    }

    /// Checks that the underline row under the source row starts below `token`.
    fn assert_underlined(report: &str, source_row: &str, token: &str, marker: char) {
        let rows: Vec<&str> = report.lines().collect();
        let at = rows
            .iter()
            .position(|row| row.ends_with(source_row))
            .unwrap_or_else(|| panic!("no row {source_row:?} in\n{report}"));
        let source = rows[at];
        let token_at = source.find(token).unwrap();
        let token_column: usize = source[..token_at].chars().map(|c| shown(c).1).sum();
        assert!(
            rows[at + 1..]
                .iter()
                .take_while(|row| row.trim_start().starts_with('|'))
                .any(|row| row.contains(marker) && column_of(row, marker) == token_column),
            "{token:?} is not underlined with {marker:?} in\n{report}"
        );
    }

    #[test]
    fn the_location_names_the_cell_line_and_character_column() {
        let code = "let a = 1;\nlet b = 2;\nlet c = a + y;\nc";
        let report = render(&undefined_y(3, 13), code, Style::Plain);
        let rows: Vec<&str> = report.lines().collect();
        assert_eq!(rows[0], "error[E0425]: cannot find value `y` in this scope");
        assert_eq!(rows[1], " --> cell line 3, column 13");
        assert_eq!(rows[3], "3 | let c = a + y;");
        assert_eq!(rows[4], "  |             ^ not found in this scope");
        assert!(!report.contains("lib.rs"));
    }

    #[test]
    fn a_chinese_comment_on_an_earlier_line_does_not_move_the_error() {
        let code = "let a = 1;\n// 你好，世界\nlet c = a + y;\nc";
        let report = render(&undefined_y(3, 13), code, Style::Plain);
        assert!(report.contains("--> cell line 3, column 13"), "{report}");
        assert_underlined(&report, "let c = a + y;", "y", '^');
        assert!(
            !report.contains("你好"),
            "only labelled lines are shown:\n{report}"
        );
    }

    #[test]
    fn wide_characters_before_the_error_on_its_line_are_underlined_past() {
        // Columns count characters: `y` is the 33rd character though the 37th byte, and sits
        // at display column 34 (each CJK character is two columns wide).
        let code = "let a = 1; /* 你好 */ let c = a + y;";
        let report = render(&undefined_y(1, 33), code, Style::Plain);
        assert!(report.contains("--> cell line 1, column 33"), "{report}");
        assert_underlined(&report, code, "y", '^');
        let underline = report.lines().nth(4).unwrap();
        // The margin "1 | " takes four columns.
        assert_eq!(column_of(underline, '^'), 4 + 34);
    }

    #[test]
    fn an_arrow_in_a_string_keeps_both_labels_under_their_tokens() {
        let code = "let s = \"a → b\"; let n: i32 = s;\nn";
        let report = render(
            &error(
                "E0308",
                "mismatched types",
                vec![
                    label(span((1, 31), (1, 32)), "expected `i32`, found `&str`", true),
                    label(span((1, 25), (1, 28)), "expected due to this", false),
                ],
            ),
            code,
            Style::Plain,
        );
        assert!(report.contains("--> cell line 1, column 31"), "{report}");
        let line = code.lines().next().unwrap();
        assert_underlined(&report, line, "i32 =", '-');
        assert_underlined(&report, line, "s;", '^');
        assert!(
            report.contains("^ expected `i32`, found `&str`"),
            "{report}"
        );
        assert!(report.contains("--- expected due to this"), "{report}");
    }

    #[test]
    fn two_errors_on_different_lines_each_name_their_own_line() {
        let code = "// 两个错误\nlet a: i32 = \"x\";\nlet b = 1;\nlet c = b + zz;\nc";
        let first = render(
            &error(
                "E0425",
                "cannot find value `zz` in this scope",
                vec![label(
                    span((4, 13), (4, 15)),
                    "not found in this scope",
                    true,
                )],
            ),
            code,
            Style::Plain,
        );
        let second = render(
            &error(
                "E0308",
                "mismatched types",
                vec![
                    label(span((2, 14), (2, 17)), "expected `i32`, found `&str`", true),
                    label(span((2, 8), (2, 11)), "expected due to this", false),
                ],
            ),
            code,
            Style::Plain,
        );
        assert!(first.contains("--> cell line 4, column 13"), "{first}");
        assert!(first.contains("  |             ^^ not found"), "{first}");
        assert!(second.contains("--> cell line 2, column 14"), "{second}");
        assert_underlined(&second, "let a: i32 = \"x\";", "\"x\"", '^');
    }

    #[test]
    fn labels_on_distant_lines_are_shown_with_a_gap_and_a_wide_gutter() {
        let mut code: String = (1..=11).map(|n| format!("let v{n} = {n};\n")).collect();
        code.push_str("f(\"s\")");
        let report = render(
            &error(
                "E0308",
                "mismatched types",
                vec![
                    label(span((12, 3), (12, 6)), "expected `i32`, found `&str`", true),
                    label(span((2, 5), (2, 7)), "defined here", false),
                ],
            ),
            &code,
            Style::Plain,
        );
        let rows: Vec<&str> = report.lines().collect();
        assert_eq!(rows[1], "  --> cell line 12, column 3");
        assert!(rows.contains(&" 2 | let v2 = 2;"), "{report}");
        assert!(rows.contains(&"..."), "{report}");
        assert!(rows.contains(&"12 | f(\"s\")"), "{report}");
    }

    #[test]
    fn a_span_over_several_lines_marks_its_first_and_last_line() {
        let code = "let v = vec![\n    1,\n    \"两\",\n];";
        let report = render(
            &error(
                "E0308",
                "mismatched types",
                vec![label(span((1, 9), (4, 2)), "this vector", true)],
            ),
            code,
            Style::Plain,
        );
        let rows: Vec<&str> = report.lines().collect();
        assert_eq!(rows[3], "1 | let v = vec![");
        assert_eq!(rows[4], "  |         ^^^^^");
        assert_eq!(rows[5], "...");
        assert_eq!(rows[6], "4 | ];");
        assert_eq!(rows[7], "  | ^ this vector");
    }

    #[test]
    fn an_error_outside_the_cell_says_so_and_keeps_its_notes() {
        let mut outside = error("E0277", "the trait bound is not satisfied", Vec::new());
        outside.notes = vec!["note: required by a bound\nsecond line".into()];
        let report = render(&outside, "let x = 1;", Style::Plain);
        let rows: Vec<&str> = report.lines().collect();
        assert_eq!(rows[0], "error[E0277]: the trait bound is not satisfied");
        assert!(rows[1].contains("not in a line of the cell"), "{report}");
        assert_eq!(rows[2], "  = note: required by a bound");
        assert_eq!(rows[3], "    second line");
        assert!(!report.contains("lib.rs"));
    }

    #[test]
    fn an_end_of_input_span_past_the_cell_is_kept_inside_it() {
        let code = "let a = 1";
        let report = render(
            &error(
                "",
                "expected `;`, found <end of input>",
                vec![label(span((1, 10), (1, 10)), "add `;` here", true)],
            ),
            code,
            Style::Plain,
        );
        assert!(report.contains("--> cell line 1, column 10"), "{report}");
        assert!(report.contains("  |          ^ add `;` here"), "{report}");
        let beyond = render(
            &error("", "x", vec![label(span((7, 40), (9, 1)), "", true)]),
            code,
            Style::Plain,
        );
        assert!(beyond.contains("--> cell line 1, column 10"), "{beyond}");
    }

    #[test]
    fn tabs_line_separators_and_crlf_do_not_shift_lines_or_underlines() {
        // rustc counts lines by \n only and a tab as one column; U+2028 inside a string would
        // start a new line in ariadne's numbering.
        let code = "let s = \"\u{2028}\";\r\n\tlet c = s + y;\r\n";
        let report = render(&undefined_y(2, 14), code, Style::Plain);
        assert!(report.contains("--> cell line 2, column 14"), "{report}");
        assert!(report.contains("2 |     let c = s + y;\n"), "{report}");
        assert_underlined(&report, "    let c = s + y;", "y", '^');
        assert!(!report.contains('\r') && !report.contains('\u{2028}'));
    }

    #[test]
    fn colours_wrap_the_header_and_marks_without_changing_the_text() {
        let diagnostic = error(
            "E0425",
            "cannot find value `y` in this scope",
            vec![label(span((1, 5), (1, 6)), "here", true)],
        );
        let coloured = render(&diagnostic, "1 + y", Style::Ansi);
        assert!(
            coloured.starts_with("\x1b[1;31merror[E0425]"),
            "{coloured:?}"
        );
        assert_eq!(
            crate::session::infer::without_colours(&coloured),
            render(&diagnostic, "1 + y", Style::Plain)
        );
    }
}
