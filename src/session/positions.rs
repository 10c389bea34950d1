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
}
