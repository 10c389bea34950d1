//! The control channel: shutdown, interrupt and kernel_info, answered even while a cell runs.

use jupyter_protocol::{
    InterruptReply, JupyterMessage, JupyterMessageContent, ReplyStatus, ShutdownReply,
};
use jupyter_zmq_client::KernelControlConnection;
use tokio::sync::oneshot;

use super::{info, next_message, Interrupter, Iopub};

/// Serves control requests until a shutdown request; then reports it through `shutdown`.
pub async fn serve(
    mut socket: KernelControlConnection,
    iopub: Iopub,
    interrupter: Interrupter,
    shutdown: oneshot::Sender<bool>,
) {
    loop {
        let request = next_message(&mut socket, "control").await;
        iopub.status(true, &request);
        let reply: Option<JupyterMessage> = match &request.content {
            JupyterMessageContent::KernelInfoRequest(_) => {
                Some(info::kernel_info().as_child_of(&request))
            }
            JupyterMessageContent::InterruptRequest(_) => {
                interrupter.interrupt();
                Some(InterruptReply::new().as_child_of(&request))
            }
            JupyterMessageContent::ShutdownRequest(shutdown_request) => {
                let restart = shutdown_request.restart;
                let reply = ShutdownReply {
                    restart,
                    status: ReplyStatus::Ok,
                    error: None,
                }
                .as_child_of(&request);
                if let Err(error) = socket.send(reply).await {
                    tracing::warn!("cannot send shutdown_reply: {error}");
                }
                iopub.status(false, &request);
                iopub.flush().await;
                let _ = shutdown.send(restart);
                return;
            }
            other => {
                tracing::info!("unsupported control request {}", other.message_type());
                None
            }
        };
        if let Some(reply) = reply {
            if let Err(error) = socket.send(reply).await {
                tracing::warn!("cannot send a control reply: {error}");
            }
        }
        iopub.status(false, &request);
    }
}
