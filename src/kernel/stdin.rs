//! Input requests: a running cell asks, the frontend that sent the request answers on stdin.

use std::sync::Arc;

use jupyter_protocol::{InputRequest, JupyterMessage, JupyterMessageContent};
use jupyter_zmq_client::KernelStdinConnection;
use tokio::sync::{mpsc, oneshot, Notify};

struct Ask {
    parent: JupyterMessage,
    prompt: String,
    password: bool,
    answer: oneshot::Sender<String>,
}

/// Handle through which the engine thread asks for input.
#[derive(Clone)]
pub struct StdinBridge {
    asks: mpsc::UnboundedSender<Ask>,
    cancelled: Arc<Notify>,
}

impl StdinBridge {
    /// Asks the frontend that sent `parent`; blocks the calling (engine) thread until it answers
    /// or the request is cancelled (interrupt), which answers an empty line.
    pub fn ask_blocking(&self, parent: &JupyterMessage, prompt: &str, password: bool) -> String {
        let (answer, answered) = oneshot::channel();
        let ask = Ask {
            parent: parent.clone(),
            prompt: prompt.to_string(),
            password,
            answer,
        };
        if self.asks.send(ask).is_err() {
            return String::new();
        }
        answered.blocking_recv().unwrap_or_default()
    }

    /// Abandons a pending input request.
    pub fn cancel(&self) {
        self.cancelled.notify_waiters();
    }
}

/// Starts the task that owns the stdin socket.
pub fn spawn(mut socket: KernelStdinConnection) -> StdinBridge {
    let (asks, mut pending) = mpsc::unbounded_channel::<Ask>();
    let cancelled = Arc::new(Notify::new());
    let bridge = StdinBridge {
        asks,
        cancelled: Arc::clone(&cancelled),
    };
    tokio::spawn(async move {
        while let Some(ask) = pending.recv().await {
            let request = InputRequest {
                prompt: ask.prompt,
                password: ask.password,
            }
            .as_child_of(&ask.parent);
            if let Err(error) = socket.send(request).await {
                tracing::warn!("cannot send input_request: {error}");
                let _ = ask.answer.send(String::new());
                continue;
            }
            let value = tokio::select! {
                value = read_reply(&mut socket) => value,
                _ = cancelled.notified() => String::new(),
            };
            let _ = ask.answer.send(value);
        }
    });
    bridge
}

async fn read_reply(socket: &mut KernelStdinConnection) -> String {
    loop {
        let message = super::next_message(socket, "stdin").await;
        if let JupyterMessageContent::InputReply(reply) = message.content {
            return reply.value;
        }
        tracing::debug!("ignoring {} on stdin", message.header.msg_type);
    }
}
