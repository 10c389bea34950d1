//! Rich output a cell printed the evcxr way (`EVCXR_BEGIN_CONTENT <mime>` … `EVCXR_END_CONTENT`),
//! which the child sends as [`tchmem_wire::CellMessage::Content`] lines: a display, or the
//! cell's result.
//!
//! evcxr shows a cell's final value by printing such blocks at the very end of the cell (the
//! value's `evcxr_display()`, else its `Debug` text as `text/plain`), and collects every block
//! of the cell into the cell's result. tchmem shows blocks printed while the cell runs as
//! `display_data`, in order with the cell's prints, and keeps evcxr's rule only for the blocks
//! that can be the final value's: when the cell ends in an expression, the blocks printed last
//! (no stdout text or other output after them, one per MIME type) are held back until the cell
//! ends and become its `execute_result`; anything printed after them shows them at once as
//! displays.

use serde_json::{Map, Value};
use tchmem_wire::{bundle_value, Display};

use crate::svg_image;

/// One block: its MIME type and content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// The MIME type after the begin marker.
    pub mime: String,
    /// The lines between the markers.
    pub content: String,
}

/// The display of a block, with a `text/plain` stand-in for frontends that show only text
/// (consoles, text exports), as `tchmem::display` adds.
pub fn display(block: Block) -> Display {
    let mut data = Map::new();
    let plain = match block.mime.as_str() {
        "text/plain" => None,
        "text/markdown" | "text/latex" => Some(block.content.clone()),
        "text/html" => Some("[HTML output]".to_string()),
        "image/svg+xml" => Some("[SVG image]".to_string()),
        mime => Some(match mime.strip_prefix("image/") {
            Some(kind) => format!("[{} image]", kind.to_uppercase()),
            None => format!("[{mime} output]"),
        }),
    };
    data.insert(
        block.mime.clone(),
        bundle_value(&block.mime, &block.content),
    );
    if let Some(plain) = plain {
        data.insert("text/plain".into(), Value::String(plain));
    }
    with_svg_image(&mut data);
    Display {
        data,
        ..Default::default()
    }
}

/// Adds an HTML image of a bundle's SVG where it has no HTML of its own. JupyterLab renders
/// `image/svg+xml` only in a notebook it trusts (opened from a file someone else saved, a
/// plot shows as "[SVG image]"), sanitized HTML in any, and prefers HTML where both are there.
pub fn with_svg_image(data: &mut Map<String, Value>) {
    if data.contains_key("text/html") {
        return;
    }
    if let Some(Value::String(svg)) = data.get("image/svg+xml") {
        let html = svg_image::img(svg, "SVG image", "");
        data.insert("text/html".into(), Value::String(html));
    }
}

/// How evcxr shows a final value of type `()`: nothing to show, never a display.
fn is_unit_value(block: &Block) -> bool {
    block.mime == "text/plain" && block.content == "()"
}

/// The blocks a running cell printed last, held back while they may be its final value's.
#[derive(Debug, Default)]
pub struct Trailing {
    /// The cell ends in an expression with a value to show.
    hold: bool,
    held: Vec<Block>,
}

impl Trailing {
    /// For a cell whose code ends in an expression with a value to show (`hold`), or not.
    pub fn new(hold: bool) -> Self {
        Self {
            hold,
            held: Vec::new(),
        }
    }

    /// A block arrived; returns the blocks to show now, in order.
    pub fn block(&mut self, block: Block) -> Vec<Block> {
        if self.hold || is_unit_value(&block) {
            // A result has one representation per MIME type: a second one of a type means the
            // first was not part of it.
            let shown = if self.held.iter().any(|held| held.mime == block.mime) {
                std::mem::take(&mut self.held)
            } else {
                Vec::new()
            };
            self.held.push(block);
            shown
        } else {
            let mut shown = std::mem::take(&mut self.held);
            shown.push(block);
            shown
        }
    }

    /// Other stdout output arrived: the held blocks were not the last; returns them to show.
    pub fn release(&mut self) -> Vec<Block> {
        std::mem::take(&mut self.held)
    }

    /// The cell ended; returns the blocks to show and the blocks of its result. A cell that
    /// failed has no result: what it printed is shown.
    pub fn finish(self, succeeded: bool) -> (Vec<Block>, Vec<Block>) {
        let mut held = self.held;
        if !succeeded {
            held.retain(|block| !is_unit_value(block));
            return (held, Vec::new());
        }
        match held.last() {
            Some(last) if is_unit_value(last) => {
                held.pop();
                (held, Vec::new())
            }
            _ => (Vec::new(), held),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Map, Value};

    use super::{display, with_svg_image, Block, Trailing};
    use crate::svg_image::svgs_in;

    fn block(mime: &str, content: &str) -> Block {
        Block {
            mime: mime.into(),
            content: content.into(),
        }
    }

    #[test]
    fn evcxr_blocks_of_a_cell_without_a_value_show_at_once() {
        let mut trailing = Trailing::new(false);
        assert_eq!(
            trailing.block(block("text/html", "<b>a</b>")),
            vec![block("text/html", "<b>a</b>")]
        );
        assert_eq!(
            trailing.block(block("text/html", "<b>b</b>")),
            vec![block("text/html", "<b>b</b>")]
        );
        // A loop ending the cell: evcxr's display of its `()` is neither shown nor a result.
        assert!(trailing.block(block("text/plain", "()")).is_empty());
        assert_eq!(trailing.finish(true), (vec![], vec![]));
    }

    #[test]
    fn evcxr_blocks_printed_last_by_a_cell_with_a_value_are_its_result() {
        let mut trailing = Trailing::new(true);
        assert!(trailing.block(block("text/html", "<b>plot</b>")).is_empty());
        // Text after it: the plot was a display.
        assert_eq!(trailing.release(), vec![block("text/html", "<b>plot</b>")]);
        assert!(trailing
            .block(block("text/html", "<i>value</i>"))
            .is_empty());
        assert!(trailing.block(block("text/plain", "value")).is_empty());
        assert_eq!(
            trailing.finish(true),
            (
                vec![],
                vec![
                    block("text/html", "<i>value</i>"),
                    block("text/plain", "value")
                ]
            )
        );
    }

    #[test]
    fn a_second_evcxr_block_of_one_type_shows_the_first() {
        let mut trailing = Trailing::new(true);
        assert!(trailing.block(block("image/png", "1")).is_empty());
        assert_eq!(
            trailing.block(block("image/png", "2")),
            vec![block("image/png", "1")]
        );
        assert_eq!(
            trailing.finish(true),
            (vec![], vec![block("image/png", "2")])
        );
    }

    #[test]
    fn evcxr_blocks_before_a_unit_value_or_a_failure_are_shown() {
        let mut trailing = Trailing::new(true);
        trailing.block(block("text/html", "<b>a</b>"));
        trailing.block(block("text/plain", "()"));
        assert_eq!(
            trailing.finish(true),
            (vec![block("text/html", "<b>a</b>")], vec![])
        );
        let mut trailing = Trailing::new(true);
        trailing.block(block("text/html", "<b>a</b>"));
        assert_eq!(
            trailing.finish(false),
            (vec![block("text/html", "<b>a</b>")], vec![])
        );
    }

    #[test]
    fn evcxr_block_displays_get_a_text_fallback() {
        let html = display(block("text/html", "<b>hi</b>"));
        assert_eq!(html.data["text/html"], "<b>hi</b>");
        assert_eq!(html.data["text/plain"], "[HTML output]");
        let png = display(block("image/png", "iVBOR"));
        assert_eq!(png.data["text/plain"], "[PNG image]");
        let markdown = display(block("text/markdown", "**x**"));
        assert_eq!(markdown.data["text/plain"], "**x**");
        let json = display(block("application/json", "{\"a\": 1}"));
        assert_eq!(json.data["application/json"]["a"], 1);
        let plain = display(block("text/plain", "just text"));
        assert_eq!(plain.data.len(), 1);
        assert!(html.display_id.is_none() && !html.update);
    }

    #[test]
    fn an_svg_shows_as_an_html_image_too_where_the_bundle_has_no_html() {
        let svg = "<svg xmlns='http://www.w3.org/2000/svg' width='48' height='24'/>";
        let shown = display(block("image/svg+xml", svg)).data;
        assert_eq!(shown["image/svg+xml"], svg);
        assert_eq!(shown["text/plain"], "[SVG image]");
        let html = shown["text/html"].as_str().unwrap();
        assert!(html.starts_with("<img alt=\"SVG image\" width=\"48\" height=\"24\""));
        assert_eq!(svgs_in(html), vec![svg.to_string()]);
        // A bundle's own HTML stays, and one without an SVG gets none.
        let mut own: Map<String, Value> =
            serde_json::from_value(json!({"image/svg+xml": svg, "text/html": "<b>mine</b>"}))
                .unwrap();
        with_svg_image(&mut own);
        assert_eq!(own["text/html"], "<b>mine</b>");
        let plain = display(block("text/markdown", "# a")).data;
        assert!(!plain.contains_key("text/html"));
    }
}
