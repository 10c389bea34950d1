//! The control channel: shutdown, interrupt and kernel_info, answered even while a cell runs.

use jupyter_protocol::{
    InterruptReply, JupyterMessage, JupyterMessageContent, ReplyStatus, ShutdownReply,
};
use jupyter_zmq_client::KernelControlConnection;
use tokio::sync::oneshot;

use super::{info, next_message, Evaluator, Interrupter, Iopub};

/// Serves control requests until a shutdown request; then reports it through `shutdown`.
pub async fn serve<E: Evaluator>(
    mut socket: KernelControlConnection,
    iopub: Iopub,
    interrupter: Interrupter<E>,
    shutdown: oneshot::Sender<bool>,
) {
    loop {
        let request = next_message(&mut socket, "control").await;
        let restart = iopub
            .with_status(&request, async {
                let (reply, restart) = answer(&request, &interrupter);
                if let Some(reply) = reply {
                    if let Err(error) = socket.send(reply).await {
                        tracing::warn!("cannot send a control reply: {error}");
                    }
                }
                restart
            })
            .await;
        if let Some(restart) = restart {
            iopub.flush().await;
            let _ = shutdown.send(restart);
            return;
        }
    }
}

/// The reply to one control request, and for a shutdown request whether it asks for a restart.
fn answer<E: Evaluator>(
    request: &JupyterMessage,
    interrupter: &Interrupter<E>,
) -> (Option<JupyterMessage>, Option<bool>) {
    match &request.content {
        JupyterMessageContent::KernelInfoRequest(_) => {
            (Some(info::kernel_info().as_child_of(request)), None)
        }
        JupyterMessageContent::InterruptRequest(_) => {
            interrupter.interrupt();
            (Some(InterruptReply::new().as_child_of(request)), None)
        }
        JupyterMessageContent::ShutdownRequest(shutdown) => {
            let reply = ShutdownReply {
                restart: shutdown.restart,
                status: ReplyStatus::Ok,
                error: None,
            };
            (Some(reply.as_child_of(request)), Some(shutdown.restart))
        }
        other => {
            tracing::info!("unsupported control request {}", other.message_type());
            (None, None)
        }
    }
}
