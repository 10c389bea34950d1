//! SVG charts in a notebook's HTML: as images whose source is the SVG itself, with an image map
//! where a chart has hover text.
//!
//! A notebook shows an output's inline SVG only while it trusts the output (one run in that
//! browser). Opened from elsewhere (a notebook a colleague sent, the repository's tutorials)
//! JupyterLab sanitizes the HTML: the SVG elements go and their text stays, run together (a
//! memory chart became one line of labels, a timeline a page of hover texts). An image shows
//! either way. The image map gives hover text where the notebook is trusted; sanitized, it
//! loses the map's name, and the image stays without it.

use std::hash::{DefaultHasher, Hash, Hasher};

use super::escape;
use crate::html::attribute;
use crate::svg_image::img;
#[cfg(test)]
pub use crate::svg_image::svgs_in;

/// A place on a chart that shows `text` under the pointer.
#[derive(Debug, Clone, PartialEq)]
pub struct Hover {
    /// Where, in the chart's pixels.
    pub spot: Spot,
    /// What the pointer shows there.
    pub text: String,
}

/// The shape of a [`Hover`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spot {
    /// From the top-left corner to the bottom-right one.
    Rect {
        /// Left edge.
        x0: i32,
        /// Top edge.
        y0: i32,
        /// Right edge.
        x1: i32,
        /// Bottom edge.
        y1: i32,
    },
    /// A circle of radius `r` around (`x`, `y`).
    Circle {
        /// Centre, across.
        x: i32,
        /// Centre, down.
        y: i32,
        /// Radius.
        r: i32,
    },
}

impl Hover {
    /// As SVG: a transparent shape with a `<title>` (for a chart saved as a file).
    pub fn svg(&self) -> String {
        let text = escape(&self.text);
        match self.spot {
            Spot::Rect { x0, y0, x1, y1 } => format!(
                "<rect x=\"{x0}\" y=\"{y0}\" width=\"{}\" height=\"{}\"><title>{text}</title></rect>",
                x1 - x0,
                y1 - y0
            ),
            Spot::Circle { x, y, r } => {
                format!("<circle cx=\"{x}\" cy=\"{y}\" r=\"{r}\"><title>{text}</title></circle>")
            }
        }
    }

    /// As an image map's `<area>`.
    fn area(&self) -> String {
        let (shape, coords) = match self.spot {
            Spot::Rect { x0, y0, x1, y1 } => ("rect", format!("{x0},{y0},{x1},{y1}")),
            Spot::Circle { x, y, r } => ("circle", format!("{x},{y},{r}")),
        };
        let text = attribute(&self.text);
        // No `alt`: an area without a link needs none, and the text would come twice.
        format!("<area shape=\"{shape}\" coords=\"{coords}\" title=\"{text}\">")
    }
}

/// `svg` as an HTML image; `alt` is what a reader without it reads.
pub fn image(svg: &str, alt: &str) -> String {
    img(svg, alt, "")
}

/// `svg` as an HTML image with `hovers` in an image map. The map's name comes from the chart and
/// its hover text (two runs of one step draw the same chart at other times), so that two charts
/// on one page (every open notebook is one page in JupyterLab) do not share one. The image keeps
/// its size (`max-width:none`): a map's coordinates do not follow an image scaled to fit.
pub fn image_with_hovers(svg: &str, alt: &str, hovers: &[Hover]) -> String {
    let mut hasher = DefaultHasher::new();
    svg.hash(&mut hasher);
    for hover in hovers {
        hover.text.hash(&mut hasher);
    }
    let name = format!("tchmem-chart-{:016x}", hasher.finish());
    let areas: String = hovers.iter().map(Hover::area).collect();
    let extra = format!(" usemap=\"#{name}\" style=\"max-width:none\"");
    format!(
        "{}<map name=\"{name}\">{areas}</map>",
        img(svg, alt, &extra)
    )
}

/// A chart drawn (or not) as HTML: the image, or a comment saying why there is none.
pub fn chart_html(chart: Result<String, String>, alt: &str) -> String {
    match chart {
        Ok(svg) => image(&svg, alt),
        Err(why) => no_chart(&why),
    }
}

/// In place of a chart that could not be drawn: an HTML comment saying why.
pub fn no_chart(why: &str) -> String {
    format!("<!-- chart: {} -->", escape(why))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::svg_image::tests::SVG;

    #[test]
    fn hovers_become_areas_of_a_map_the_image_names() {
        let hovers = [
            Hover {
                spot: Spot::Rect {
                    x0: 1,
                    y0: 2,
                    x1: 5,
                    y1: 9,
                },
                text: "column <1>".into(),
            },
            Hover {
                spot: Spot::Circle { x: 4, y: 4, r: 3 },
                text: "peak".into(),
            },
        ];
        let html = image_with_hovers(SVG, "timeline", &hovers);
        let name = html
            .split("usemap=\"#")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .unwrap();
        assert!(html.contains(&format!("<map name=\"{name}\">")), "{html}");
        assert!(
            html.contains("<area shape=\"rect\" coords=\"1,2,5,9\" title=\"column &lt;1&gt;\">")
        );
        assert!(html.contains("<area shape=\"circle\" coords=\"4,4,3\" title=\"peak\""));
        assert_eq!(svgs_in(&html), vec![SVG.to_string()]);
        assert!(html.contains("style=\"max-width:none\""), "{html}");
        // Another chart, another map; and the same chart with other hover text.
        let other = image_with_hovers(&SVG.replace('a', "c"), "timeline", &hovers);
        assert!(!other.contains(&format!("\"#{name}\"")));
        let later = image_with_hovers(SVG, "timeline", &hovers[..1]);
        assert!(!later.contains(&format!("\"#{name}\"")));
        // In a saved file the hovers are SVG titles.
        assert_eq!(
            hovers[1].svg(),
            "<circle cx=\"4\" cy=\"4\" r=\"3\"><title>peak</title></circle>"
        );
    }

    #[test]
    fn a_chart_that_failed_leaves_a_comment() {
        assert_eq!(
            chart_html(Err("no room".into()), "x"),
            "<!-- chart: no room -->"
        );
    }
}
