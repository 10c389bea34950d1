//! An SVG as an HTML `<img>` whose source is the SVG itself.
//!
//! JupyterLab renders an output's `image/svg+xml`, and inline SVG in its HTML, only in a notebook
//! it trusts (one run in that browser). Opened from a file someone else saved it sanitizes the
//! HTML, and an image of the SVG is what stays. The report's charts (`report::embed`) and a
//! cell's own SVG output (`session::rich`) both go through here.

use data_encoding::BASE64;

use crate::html::attribute;

/// `svg` as an `<img>` with the SVG's own size (the page keeps its place while the image
/// decodes: a live view replaces it every quarter second), `alt` for a reader without it, and
/// `extra` attributes (written as they are).
pub fn img(svg: &str, alt: &str, extra: &str) -> String {
    let size: String = ["width", "height"]
        .iter()
        .filter_map(|name| Some(format!(" {name}=\"{}\"", svg_size(svg, name)?)))
        .collect();
    format!(
        "<img alt=\"{}\"{size}{extra} src=\"data:image/svg+xml;base64,{}\">",
        attribute(alt),
        BASE64.encode(svg.as_bytes())
    )
}

/// The `width` or `height` the root `<svg>` element gives, in pixels (in either quotes).
fn svg_size(svg: &str, name: &str) -> Option<u32> {
    let root = &svg[svg.find("<svg")?..];
    let root = &root[..root.find('>')?];
    ['"', '\''].iter().find_map(|&quote| {
        let at = root.find(&format!(" {name}={quote}"))? + name.len() + 3;
        root[at..].split(quote).next()?.parse().ok()
    })
}

/// The SVG documents of the images in `html`, in order (what the tests read charts by).
#[cfg(test)]
pub fn svgs_in(html: &str) -> Vec<String> {
    const SOURCE: &str = "src=\"data:image/svg+xml;base64,";
    html.match_indices(SOURCE)
        .filter_map(|(at, _)| {
            let data = &html[at + SOURCE.len()..];
            let data = &data[..data.find('"')?];
            String::from_utf8(BASE64.decode(data.as_bytes()).ok()?).ok()
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small SVG with a size and text that needs escaping (the report's tests use it too).
    pub(crate) const SVG: &str =
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"10\" height=\"12\">\
                       <text>a &amp; b</text></svg>";

    #[test]
    fn an_image_carries_its_svg_whole_and_no_markup_of_it() {
        let html = img(SVG, "peak \"now\"", "");
        assert!(
            html.starts_with(
                "<img alt=\"peak &quot;now&quot;\" width=\"10\" height=\"12\" \
                 src=\"data:image/svg+xml;base64,"
            ),
            "{html}"
        );
        assert!(!html.contains("<svg") && !html.contains("<text"), "{html}");
        assert_eq!(svgs_in(&html), vec![SVG.to_string()]);
        // Sized from single quotes too, as hand-written SVG often has them.
        let single = "<svg xmlns='http://www.w3.org/2000/svg' width='480' height='240'/>";
        assert!(img(single, "", "").contains(" width=\"480\" height=\"240\" "));
    }
}
