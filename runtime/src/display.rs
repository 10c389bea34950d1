//! Rich output from inside a cell, shown as it happens (Jupyter `display_data`).
//!
//! ```no_run
//! tchmem::display::html("<b>step 1</b>");
//! let progress = tchmem::display::Handle::new("text/plain", "0%");
//! progress.update("text/plain", "50%");
//! tchmem::display::clear_output(false);
//! ```

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Map, Value};
use tchmem_show::result_block;
use tchmem_wire::{CellMessage, Display};

/// Shows one output with the given representations (`(mime, content)` pairs). JSON MIME types
/// (`application/json`, `…+json`) take JSON text and are sent as JSON.
pub fn show(representations: &[(&str, &str)]) {
    emit(&Display {
        data: bundle(representations),
        ..Default::default()
    });
}

/// Shows HTML.
pub fn html(html: &str) {
    show(&[("text/html", html), ("text/plain", "[HTML output]")]);
}

/// Shows an SVG image.
pub fn svg(svg: &str) {
    show(&[("image/svg+xml", svg), ("text/plain", "[SVG image]")]);
}

/// Shows Markdown.
pub fn markdown(markdown: &str) {
    show(&[("text/markdown", markdown), ("text/plain", markdown)]);
}

/// Shows plain text as a rich output (not as stdout).
pub fn text(text: &str) {
    show(&[("text/plain", text)]);
}

/// An output that can be replaced in place, e.g. a progress line.
pub struct Handle {
    id: String,
}

impl Handle {
    /// Shows `content` as `mime` and returns a handle to replace it later.
    pub fn new(mime: &str, content: &str) -> Handle {
        // Each cell links its own copy of this crate (and of this counter), so the id also
        // carries the time, which differs between cells.
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let id = format!(
            "tchmem-{}-{nanos}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        emit(&Display {
            data: bundle(&[(mime, content)]),
            display_id: Some(id.clone()),
            ..Default::default()
        });
        Handle { id }
    }

    /// Replaces the output with `content` as `mime`.
    pub fn update(&self, mime: &str, content: &str) {
        emit(&Display {
            data: bundle(&[(mime, content)]),
            display_id: Some(self.id.clone()),
            update: true,
            ..Default::default()
        });
    }
}

fn bundle(representations: &[(&str, &str)]) -> Map<String, Value> {
    representations
        .iter()
        .map(|(mime, content)| (mime.to_string(), tchmem_wire::bundle_value(mime, content)))
        .collect()
}

/// Clears the cell's output; with `wait`, only once new output arrives (for redrawing).
pub fn clear_output(wait: bool) {
    send(&CellMessage::ClearOutput { wait });
}

fn emit(display: &Display) {
    send(&CellMessage::Display(display.clone()));
}

/// Writes a message for the kernel: one whole line, flushed, since the kernel reads stdout line
/// by line.
pub(crate) fn send(message: &CellMessage) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", message.to_line()).and_then(|_| out.flush());
}

/// `value` as JSON in [`result_block`]: the measurements a kernel-written cell ends in.
pub(crate) fn json_result(mime: &str, value: &impl serde::Serialize) {
    result_block(mime, &serde_json::to_string(value).unwrap_or_default());
}

/// The value a cell ends in, shown with `Debug` in one compile (see the `tchmem-show` crate).
pub use tchmem_show::ShowDebugValue;
