//! Finds rich output printed the evcxr way in the cell's stdout lines.
//!
//! evcxr's format (evcxr 0.22, `eval_context.rs`): a line containing `EVCXR_BEGIN_CONTENT
//! <mime>` (the MIME type is the word after the marker), the content on the following lines, and
//! a line that is exactly `EVCXR_END_CONTENT`. `evcxr_runtime::mime_type(..)`, plotters' `evcxr`
//! feature and evcxr's own display of a cell's value print it. evcxr's parent collects such
//! blocks into the cell's result; the child takes them out of stdout first and sends each as a
//! [`CellMessage::Content`](tchmem_wire::CellMessage) line, in order with the text around it, so
//! that the engine can show blocks printed while the cell runs as displays.

use tchmem_wire::{EVCXR_BEGIN_CONTENT, EVCXR_END_CONTENT};

/// A piece of stdout, in order.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece {
    /// A line of text to pass on (without its newline).
    Text(Vec<u8>),
    /// A complete block.
    Block {
        /// Its MIME type.
        mime: String,
        /// The lines between the markers, joined by newlines.
        content: String,
    },
}

struct Open {
    mime: String,
    content: Option<String>,
}

/// Reads stdout line by line; remembers a block that has begun.
#[derive(Default)]
pub struct BlockReader {
    open: Option<Open>,
}

impl BlockReader {
    /// Takes one stdout line (without its newline); appends what it completes to `out`.
    pub fn line(&mut self, line: &[u8], out: &mut Vec<Piece>) {
        if let Some(open) = &mut self.open {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line == EVCXR_END_CONTENT.as_bytes() {
                self.end(out);
                return;
            }
            let text = String::from_utf8_lossy(line);
            match &mut open.content {
                Some(content) => {
                    content.push('\n');
                    content.push_str(&text);
                }
                None => open.content = Some(text.into_owned()),
            }
            return;
        }
        match find_begin(line) {
            Some((at, mime)) => {
                // Text printed without a newline before the block stays text, on a line of its
                // own (evcxr would drop it).
                if at > 0 {
                    out.push(Piece::Text(line[..at].to_vec()));
                }
                self.open = Some(Open {
                    mime,
                    content: None,
                });
            }
            None => out.push(Piece::Text(line.to_vec())),
        }
    }

    /// Ends a block that has begun (the cell ended or panicked before `EVCXR_END_CONTENT`): as
    /// evcxr does on a panic, what arrived so far is the block's content.
    pub fn end(&mut self, out: &mut Vec<Piece>) {
        if let Some(open) = self.open.take() {
            out.push(Piece::Block {
                mime: open.mime,
                content: open.content.unwrap_or_default(),
            });
        }
    }
}

/// Where the first `EVCXR_BEGIN_CONTENT <mime>` in `line` starts, and its MIME type (the
/// characters up to the next space, as evcxr's `EVCXR_BEGIN_CONTENT ([^ ]+)`).
fn find_begin(line: &[u8]) -> Option<(usize, String)> {
    let marker = EVCXR_BEGIN_CONTENT.as_bytes();
    let mut from = 0;
    while let Some(offset) = line[from..]
        .windows(marker.len())
        .position(|window| window == marker)
    {
        let at = from + offset;
        let rest = &line[at + marker.len()..];
        if let Some(rest) = rest.strip_prefix(b" ") {
            let word = rest.split(|&b| b == b' ').next().unwrap_or_default();
            let mime = String::from_utf8_lossy(word).trim_end().to_string();
            if !mime.is_empty() {
                return Some((at, mime));
            }
        }
        from = at + 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::{BlockReader, Piece};

    fn read(chunks: &[&str]) -> Vec<Piece> {
        let mut reader = BlockReader::default();
        let mut out = Vec::new();
        for line in chunks {
            reader.line(line.as_bytes(), &mut out);
        }
        reader.end(&mut out);
        out
    }

    fn text(line: &str) -> Piece {
        Piece::Text(line.as_bytes().to_vec())
    }

    fn block(mime: &str, content: &str) -> Piece {
        Piece::Block {
            mime: mime.into(),
            content: content.into(),
        }
    }

    #[test]
    fn evcxr_blocks_are_taken_out_of_the_text_around_them_in_order() {
        assert_eq!(
            read(&[
                "before",
                "EVCXR_BEGIN_CONTENT text/html",
                "<b>hi</b>",
                "EVCXR_END_CONTENT",
                "after",
            ]),
            vec![
                text("before"),
                block("text/html", "<b>hi</b>"),
                text("after")
            ]
        );
    }

    #[test]
    fn evcxr_content_on_several_lines_keeps_its_newlines() {
        assert_eq!(
            read(&[
                "EVCXR_BEGIN_CONTENT image/svg+xml",
                "<svg>",
                "",
                "  <rect/>",
                "</svg>",
                "EVCXR_END_CONTENT",
                "EVCXR_BEGIN_CONTENT text/plain",
                "EVCXR_END_CONTENT",
            ]),
            vec![
                block("image/svg+xml", "<svg>\n\n  <rect/>\n</svg>"),
                block("text/plain", ""),
            ]
        );
    }

    #[test]
    fn evcxr_begin_marker_after_text_on_one_line_keeps_the_text() {
        assert_eq!(
            read(&[
                "50% EVCXR_BEGIN_CONTENT text/markdown extra words",
                "**done**",
                "EVCXR_END_CONTENT"
            ]),
            vec![text("50% "), block("text/markdown", "**done**")]
        );
    }

    #[test]
    fn evcxr_markers_without_a_mime_type_are_text() {
        for line in [
            "EVCXR_BEGIN_CONTENT",
            "EVCXR_BEGIN_CONTENT ",
            "EVCXR_BEGIN_CONTENT  text/html",
            "EVCXR_END_CONTENT",
        ] {
            assert_eq!(read(&[line]), vec![text(line)]);
        }
        // evcxr looks further along the line for a good marker.
        assert_eq!(
            read(&[
                "EVCXR_BEGIN_CONTENT  EVCXR_BEGIN_CONTENT text/html",
                "x",
                "EVCXR_END_CONTENT"
            ]),
            vec![text("EVCXR_BEGIN_CONTENT  "), block("text/html", "x")]
        );
    }

    #[test]
    fn an_evcxr_block_left_open_ends_with_what_arrived() {
        assert_eq!(
            read(&["EVCXR_BEGIN_CONTENT text/html", "<i>half"]),
            vec![block("text/html", "<i>half")]
        );
    }

    #[test]
    fn evcxr_lines_ending_in_a_carriage_return_lose_it() {
        assert_eq!(
            read(&[
                "EVCXR_BEGIN_CONTENT text/plain\r",
                "a\r",
                "EVCXR_END_CONTENT\r"
            ]),
            vec![block("text/plain", "a")]
        );
    }
}
