//! The single owner of the IOPub socket.
//!
//! Every task that publishes sends an [`IopubEvent`] here; nothing else touches the socket, so
//! messages go out in the order they were sent. Stream text is batched: consecutive pieces of one
//! stream for one request become one message, flushed after [`STREAM_BATCH`] or as soon as
//! anything else is published (so output always precedes results, errors and `idle`).
//! Subscriptions on the XPUB socket are answered with `iopub_welcome` (JEP 65).

use std::time::Duration;

use bytes::Bytes;
use jupyter_protocol::{
    IoPubWelcome, JupyterMessage, JupyterMessageContent, Status, Stdio, StreamContent,
};
use jupyter_zmq_client::{KernelIoPubXPubConnection, SubscriptionEvent};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// Longest time stream text waits to be batched with more.
const STREAM_BATCH: Duration = Duration::from_millis(50);

/// Something to publish.
pub enum IopubEvent {
    /// A complete message.
    Message(Box<JupyterMessage>),
    /// Stream text produced for `parent`.
    Stream {
        /// The request the text belongs to.
        parent: Box<JupyterMessage>,
        /// stdout or stderr.
        name: Stdio,
        /// The text.
        text: String,
    },
    /// Resolves once everything sent before it is on the socket.
    Flush(oneshot::Sender<()>),
}

/// A cheap handle to publish through the owner.
#[derive(Clone)]
pub struct Iopub {
    events: mpsc::UnboundedSender<IopubEvent>,
}

impl Iopub {
    /// Publishes `content` as a child of `parent`.
    pub fn publish(&self, content: impl Into<JupyterMessageContent>, parent: &JupyterMessage) {
        let message = JupyterMessage::new(content.into(), Some(parent));
        let _ = self.events.send(IopubEvent::Message(Box::new(message)));
    }

    /// Publishes `busy` or `idle` for `parent`.
    fn status(&self, busy: bool, parent: &JupyterMessage) {
        self.publish(if busy { Status::busy() } else { Status::idle() }, parent);
    }

    /// Does `work` for the request `parent` between its `busy` and its `idle`: every request on
    /// every channel is answered this way.
    pub async fn with_status<T>(
        &self,
        parent: &JupyterMessage,
        work: impl std::future::Future<Output = T>,
    ) -> T {
        self.status(true, parent);
        let done = work.await;
        self.status(false, parent);
        done
    }

    /// A handle whose events come out of the returned receiver instead of a socket's owner
    /// (the owner task reads it; tests read it directly).
    pub fn channel() -> (Iopub, mpsc::UnboundedReceiver<IopubEvent>) {
        let (events, receiver) = mpsc::unbounded_channel();
        (Iopub { events }, receiver)
    }

    /// Queues stream text for batching.
    pub fn stream(&self, parent: &JupyterMessage, name: Stdio, text: String) {
        let _ = self.events.send(IopubEvent::Stream {
            parent: Box::new(parent.clone()),
            name,
            text,
        });
    }

    /// Waits until everything published so far has been sent.
    pub async fn flush(&self) {
        let (done, flushed) = oneshot::channel();
        if self.events.send(IopubEvent::Flush(done)).is_ok() {
            let _ = flushed.await;
        }
    }
}

/// Starts the owner task on `socket`.
pub fn spawn(socket: KernelIoPubXPubConnection) -> Iopub {
    let (iopub, receiver) = Iopub::channel();
    tokio::spawn(run(socket, receiver));
    iopub
}

struct PendingStream {
    parent: Box<JupyterMessage>,
    name: Stdio,
    text: String,
    since: Instant,
}

impl PendingStream {
    fn continues(&self, parent: &JupyterMessage, name: &Stdio) -> bool {
        self.parent.header.msg_id == parent.header.msg_id
            && std::mem::discriminant(&self.name) == std::mem::discriminant(name)
    }
}

async fn run(
    mut socket: KernelIoPubXPubConnection,
    mut events: mpsc::UnboundedReceiver<IopubEvent>,
) {
    let mut pending: Option<PendingStream> = None;
    loop {
        let deadline = pending.as_ref().map(|p| p.since + STREAM_BATCH);
        tokio::select! {
            event = events.recv() => {
                let Some(event) = event else { break };
                match event {
                    IopubEvent::Stream { parent, name, text } => {
                        match pending.as_mut() {
                            Some(batch) if batch.continues(&parent, &name) => batch.text.push_str(&text),
                            _ => {
                                send_pending(&mut socket, pending.take()).await;
                                pending = Some(PendingStream { parent, name, text, since: Instant::now() });
                            }
                        }
                    }
                    IopubEvent::Message(message) => {
                        send_pending(&mut socket, pending.take()).await;
                        send(&mut socket, *message).await;
                    }
                    IopubEvent::Flush(done) => {
                        send_pending(&mut socket, pending.take()).await;
                        let _ = done.send(());
                    }
                }
            }
            _ = sleep_until(deadline) => send_pending(&mut socket, pending.take()).await,
            subscription = socket.recv_subscription() => match subscription {
                Ok(SubscriptionEvent::Subscribe(topic)) => {
                    send(&mut socket, JupyterMessage::new(IoPubWelcome::new(topic), None)).await;
                }
                Ok(SubscriptionEvent::Unsubscribe(_)) => {}
                Err(error) => tracing::debug!("iopub subscription: {error}"),
            },
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

async fn send_pending(socket: &mut KernelIoPubXPubConnection, pending: Option<PendingStream>) {
    if let Some(batch) = pending {
        let content = StreamContent {
            name: batch.name,
            text: batch.text,
        };
        send(socket, JupyterMessage::new(content, Some(&batch.parent))).await;
    }
}

async fn send(socket: &mut KernelIoPubXPubConnection, mut message: JupyterMessage) {
    // On IOPub the routing frames are a topic, not the requester's identity.
    message.zmq_identities = vec![Bytes::from(format!(
        "kernel.tchmem.{}",
        message.message_type()
    ))];
    if let Err(error) = socket.send(message).await {
        tracing::warn!("iopub send failed: {error}");
    }
}
