//! Jupyter counts cursor positions in Unicode scalar values; evcxr wants byte offsets.

/// Byte offset of the `chars`-th character of `text` (clamped to its end).
pub fn char_to_byte(text: &str, chars: usize) -> usize {
    text.char_indices()
        .nth(chars)
        .map_or(text.len(), |(byte, _)| byte)
}

/// Number of characters before byte offset `byte` of `text` (clamped to its end).
pub fn byte_to_char(text: &str, byte: usize) -> usize {
    let byte = byte.min(text.len());
    text.char_indices().take_while(|(b, _)| *b < byte).count()
}

/// Byte offset in `code` of a position the parser gave for `code` wrapped in a block whose
/// first line is the brace (cell line `k`, 0-based, is the parser's line `k + 2`; columns count
/// characters); `None` outside the cell.
pub fn offset_in_block(code: &str, at: proc_macro2::LineColumn) -> Option<usize> {
    let line_start = if at.line == 2 {
        0
    } else {
        code.match_indices('\n').nth(at.line.checked_sub(3)?)?.0 + 1
    };
    Some(line_start + char_to_byte(&code[line_start..], at.column))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_multibyte_text() {
        let text = "let µ = 1; µ.";
        let byte = char_to_byte(text, 12);
        assert_eq!(&text[byte..], ".");
        assert_eq!(byte_to_char(text, byte), 12);
        assert_eq!(char_to_byte(text, 999), text.len());
    }

    #[test]
    fn block_positions_map_back_to_the_cell() {
        let code = "let a = 1;\nlet µb = 2;";
        let at = |line, column| proc_macro2::LineColumn { line, column };
        assert_eq!(offset_in_block(code, at(2, 4)), Some(4));
        assert_eq!(&code[offset_in_block(code, at(3, 6)).unwrap()..], " = 2;");
        assert_eq!(offset_in_block(code, at(1, 0)), None);
        assert_eq!(offset_in_block(code, at(9, 0)), None);
    }
}
