//! The kernel_info reply.

use jupyter_protocol::{CodeMirrorMode, HelpLink, KernelInfoReply, LanguageInfo, ReplyStatus};

/// What this kernel says about itself and its language.
pub fn kernel_info() -> KernelInfoReply {
    KernelInfoReply {
        status: ReplyStatus::Ok,
        protocol_version: "5.3".into(),
        implementation: "tchmem".into(),
        implementation_version: env!("CARGO_PKG_VERSION").into(),
        language_info: LanguageInfo {
            name: "rust".into(),
            version: rustc_version(),
            mimetype: Some("text/rust".into()),
            file_extension: Some(".rs".into()),
            pygments_lexer: Some("rust".into()),
            codemirror_mode: Some(CodeMirrorMode::Simple("rust".into())),
            nbconvert_exporter: None,
        },
        banner: format!(
            "tchmem {}: Rust cells on tch {} (libtorch 2.11) with GPU memory recording",
            env!("CARGO_PKG_VERSION"),
            crate::engine::TCH_VERSION
        ),
        help_links: vec![
            HelpLink {
                text: "tch documentation".into(),
                url: "https://docs.rs/tch/0.24.0/tch/".into(),
            },
            HelpLink {
                text: "evcxr commands (:dep, :vars, …)".into(),
                url: "https://github.com/evcxr/evcxr/blob/main/COMMON.md".into(),
            },
        ],
        debugger: false,
        error: None,
    }
}

/// The version of the rustc that compiles cells, read once.
fn rustc_version() -> String {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION
        .get_or_init(|| {
            std::process::Command::new("rustc")
                .arg("--version")
                .output()
                .ok()
                .and_then(|out| {
                    String::from_utf8(out.stdout)
                        .ok()?
                        .split_whitespace()
                        .nth(1)
                        .map(str::to_string)
                })
                .unwrap_or_else(|| "unknown".into())
        })
        .clone()
}
