//! Reading requests off a socket: signature check, then a tolerant parse.
//!
//! `jupyter-zmq-client` verifies the HMAC, but its parser rejects requests that leave out fields
//! real clients do leave out (jupyter_client's `history(hist_access_type="search")` sends no `n`
//! or `unique`), and a rejected request gets no reply, which hangs the client. So the frames are
//! decoded here: the signature is checked by the crate, the JSON is parsed by us, and missing
//! optional fields get the defaults ipykernel uses.

use jupyter_protocol::{JupyterMessage, JupyterMessageContent};
use jupyter_zmq_client::{Connection, RawMessage};
use serde_json::{json, Value};

/// Why a message was dropped.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Transport failure.
    #[error("receive failed: {0}")]
    Receive(#[from] zeromq::ZmqError),
    /// Bad framing or signature (the crate's verdict).
    #[error("{0}")]
    Frames(#[from] jupyter_zmq_client::RuntimeError),
    /// Signed correctly but not a message we can read.
    #[error("unreadable {part}: {source}")]
    Json {
        /// Which frame.
        part: &'static str,
        /// The parser's complaint.
        source: serde_json::Error,
    },
}

/// The next well-formed, correctly signed message on `socket`. Anything else (a wrong or missing
/// signature, garbage frames, unparsable JSON) is logged and dropped.
pub async fn next_message<S: zeromq::SocketRecv>(
    socket: &mut Connection<S>,
    channel: &str,
) -> JupyterMessage {
    loop {
        match receive(socket).await {
            Ok(message) => return message,
            Err(error) => tracing::warn!("dropped a message on {channel}: {error}"),
        }
    }
}

async fn receive<S: zeromq::SocketRecv>(
    socket: &mut Connection<S>,
) -> Result<JupyterMessage, DecodeError> {
    let frames = socket.socket.recv().await?;
    let raw = RawMessage::from_multipart(frames, &socket.mac)?;
    decode(raw)
}

fn decode(raw: RawMessage) -> Result<JupyterMessage, DecodeError> {
    let json = |part: &'static str, bytes: &[u8]| {
        serde_json::from_slice::<Value>(bytes).map_err(|source| DecodeError::Json { part, source })
    };
    let header = serde_json::from_value(json("header", &raw.jparts[0])?).map_err(|source| {
        DecodeError::Json {
            part: "header",
            source,
        }
    })?;
    // An empty parent header is `{}`, which is no header.
    let parent_header = serde_json::from_slice(&raw.jparts[1]).ok();
    let metadata = json("metadata", &raw.jparts[2])?;
    let mut content = json("content", &raw.jparts[3])?;
    let msg_type: String = serde_json::from_slice::<Value>(&raw.jparts[0])
        .ok()
        .and_then(|h| h["msg_type"].as_str().map(str::to_string))
        .unwrap_or_default();
    fill_defaults(&msg_type, &mut content);
    let content =
        JupyterMessageContent::from_type_and_content(&msg_type, content).map_err(|source| {
            DecodeError::Json {
                part: "content",
                source,
            }
        })?;
    Ok(JupyterMessage {
        zmq_identities: raw.zmq_identities,
        header,
        parent_header,
        metadata,
        content,
        buffers: raw.jparts[4..].to_vec(),
        channel: None,
    })
}

/// Adds the fields a request may leave out, with ipykernel's defaults.
fn fill_defaults(msg_type: &str, content: &mut Value) {
    let Some(fields) = content.as_object_mut() else {
        return;
    };
    let defaults = match (
        msg_type,
        fields.get("hist_access_type").and_then(Value::as_str),
    ) {
        ("history_request", Some("tail")) => json!({"n": 10, "output": false, "raw": true}),
        ("history_request", Some("range")) => {
            json!({"session": null, "start": 0, "stop": 0, "output": false, "raw": true})
        }
        ("history_request", Some("search")) => {
            json!({"pattern": "*", "unique": false, "n": 0, "output": false, "raw": true})
        }
        ("execute_request", _) => json!({
            "silent": false, "store_history": true, "user_expressions": {},
            "allow_stdin": true, "stop_on_error": true,
        }),
        _ => return,
    };
    for (key, value) in defaults.as_object().into_iter().flatten() {
        let missing = fields.get(key).is_none_or(Value::is_null) && !value.is_null();
        if missing || !fields.contains_key(key) {
            fields.insert(key.clone(), value.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_search_without_n_or_unique_is_readable() {
        let mut content = json!({"hist_access_type": "search", "pattern": "6*", "output": false,
                                 "raw": true});
        fill_defaults("history_request", &mut content);
        let parsed = JupyterMessageContent::from_type_and_content("history_request", content);
        assert!(parsed.is_ok(), "{parsed:?}");
    }

    #[test]
    fn given_fields_are_kept() {
        let mut content = json!({"hist_access_type": "tail", "n": 3});
        fill_defaults("history_request", &mut content);
        assert_eq!(content["n"], 3);
        assert_eq!(content["raw"], true);
    }
}
