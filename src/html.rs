//! Text written into HTML: the report's tables and messages, and the attributes of the images
//! the report and the session make of SVG outputs. Below both, so neither imports the other.

/// `text` as an element's content.
pub fn text(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// `text` as an attribute's value in double quotes.
pub fn attribute(value: &str) -> String {
    text(value).replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markup_and_quotes_are_written_as_entities() {
        assert_eq!(
            text("a < b && c > \"d\""),
            "a &lt; b &amp;&amp; c &gt; \"d\""
        );
        assert_eq!(attribute("a < \"b\" & c"), "a &lt; &quot;b&quot; &amp; c");
    }
}
