//! Input requests: a running cell asks, the frontend that sent the request answers on stdin.

use jupyter_protocol::{InputRequest, JupyterMessage, JupyterMessageContent};
use jupyter_zmq_client::KernelStdinConnection;
use tokio::sync::{mpsc, oneshot, watch};

struct Ask {
    parent: JupyterMessage,
    prompt: String,
    password: bool,
    /// The cancel generation when the cell asked; any later cancel abandons this request.
    generation: u64,
    answer: oneshot::Sender<String>,
}

/// Handle through which the engine thread asks for input.
#[derive(Clone)]
pub struct StdinBridge {
    asks: mpsc::UnboundedSender<Ask>,
    cancels: watch::Sender<u64>,
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
            generation: *self.cancels.borrow(),
            answer,
        };
        if self.asks.send(ask).is_err() {
            return String::new();
        }
        answered.blocking_recv().unwrap_or_default()
    }

    /// A bridge with no frontend behind it: every request answers an empty line (for tests).
    #[cfg(test)]
    pub fn unconnected() -> StdinBridge {
        let (asks, _) = mpsc::unbounded_channel();
        let (cancels, _) = watch::channel(0u64);
        StdinBridge { asks, cancels }
    }

    /// Abandons the pending input request, if any (also one not sent yet).
    pub fn cancel(&self) {
        self.cancels.send_modify(|generation| *generation += 1);
    }
}

/// Starts the task that owns the stdin socket.
pub fn spawn(mut socket: KernelStdinConnection) -> StdinBridge {
    let (asks, mut pending) = mpsc::unbounded_channel::<Ask>();
    let (cancels, mut cancelled) = watch::channel(0u64);
    tokio::spawn(async move {
        while let Some(ask) = pending.recv().await {
            let value = answer(&mut socket, &mut cancelled, &ask).await;
            let _ = ask.answer.send(value);
        }
    });
    StdinBridge { asks, cancels }
}

/// Sends one input request and waits for its reply; empty if cancelled.
async fn answer(
    socket: &mut KernelStdinConnection,
    cancelled: &mut watch::Receiver<u64>,
    ask: &Ask,
) -> String {
    if *cancelled.borrow_and_update() != ask.generation {
        return String::new();
    }
    let request = InputRequest {
        prompt: ask.prompt.clone(),
        password: ask.password,
    }
    .as_child_of(&ask.parent);
    if let Err(error) = socket.send(request).await {
        tracing::warn!("cannot send input_request: {error}");
        return String::new();
    }
    loop {
        tokio::select! {
            // jupyter_client sends input_reply without a parent header, so a reply cannot be
            // matched to its request; one request is outstanding at a time.
            message = super::next_message(socket, "stdin") => match message.content {
                JupyterMessageContent::InputReply(reply) => return reply.value,
                _ => tracing::debug!("ignoring {} on stdin", message.header.msg_type),
            },
            changed = cancelled.changed() => {
                if changed.is_err() || *cancelled.borrow_and_update() != ask.generation {
                    return String::new();
                }
            }
        }
    }
}
