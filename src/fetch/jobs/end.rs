//! How a job ends (SPEC §5.2): acked when its work is done, then the
//! server's next job enqueued if work was queued while it ran; or given
//! back with a delay (parked, the server backing off, our own failure,
//! stopping).

use std::time::Duration;

use async_nats::jetstream::{AckKind, Message};
use ruma::OwnedServerName;

use super::{Fetcher, JobEnd, LOCAL_RETRY, PULL_EXPIRY};
use crate::bus::fetch_jobs;
use crate::faults::Fault;
use crate::shutdown::Shutdown;
use crate::store::now_ms;

/// The first wait before enqueueing a server's next job again.
const ENQUEUE_RETRY_FIRST: Duration = Duration::from_millis(100);
/// The longest wait between tries of that enqueue.
const ENQUEUE_RETRY_MAX: Duration = Duration::from_secs(5);

impl Fetcher {
    /// Ends the job message as `end` says: acked, or given back with a delay.
    pub(super) async fn end_job(
        &self,
        message: &Message,
        server: &OwnedServerName,
        end: JobEnd,
        shutdown: &Shutdown,
    ) {
        let delay = match end {
            JobEnd::Done => {
                if let Err(e) = self.ack_done(message).await {
                    // The ack may still have reached NATS (its reply lost
                    // in a leader election): the job may be gone, so look
                    // below as after an ack. If it is not gone, it runs
                    // again and the enqueue is refused as a duplicate.
                    tracing::warn!(error = %e, %server, "fetch job ack failed; it may run again");
                }
                // Users marked stale while this job was in hand could not
                // enqueue a second job for the server: look again.
                // Any stale user or revalidation counts, due or still in
                // its own back-off.
                match self
                    .in_turn(|| self.store.has_fetch_work(server, i64::MAX))
                    .await
                {
                    Ok(true) => self.enqueue(server, shutdown).await,
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot check for stale users; enqueueing anyway");
                        self.enqueue(server, shutdown).await;
                    }
                }
                return;
            }
            JobEnd::Parked(due_ms) => {
                let left = Duration::from_millis(u64::try_from(due_ms - now_ms()).unwrap_or(0));
                tracing::debug!(%server, ?left, "every user left is in its own back-off");
                left
            }
            JobEnd::ServerFailed {
                failures,
                wait,
                error,
            } => {
                tracing::info!(%server, failures, ?wait, %error, "server failed; backing off");
                wait
            }
            JobEnd::Local => LOCAL_RETRY,
            // Stopping: give the job back, delayed past this replica's open
            // pull so it is not handed straight back to us.
            JobEnd::Interrupted => PULL_EXPIRY * 2,
        };
        let _ = message.ack_with(AckKind::Nak(Some(delay))).await;
    }

    /// Acks a finished job, waiting for NATS to confirm it.
    async fn ack_done(&self, message: &Message) -> Result<(), async_nats::Error> {
        message.double_ack().await?;
        if self.faults.is_armed(Fault::LoseJobAckReply) {
            return Err("fault injection: the ack's reply was lost".into());
        }
        Ok(())
    }

    /// Enqueues the server's next job after this one was acked. Nothing
    /// else would (the work's own enqueue was refused while this job was
    /// pending), so a failure (the stream's leader moving) is retried until
    /// it succeeds; on shutdown the start-up rescan enqueues it.
    async fn enqueue(&self, server: &OwnedServerName, shutdown: &Shutdown) {
        let mut wait = ENQUEUE_RETRY_FIRST;
        loop {
            let Err(e) = fetch_jobs::enqueue(&self.js, [server]).await else {
                return;
            };
            tracing::warn!(error = %e, %server, ?wait, "cannot enqueue the server's next fetch job; retrying");
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = shutdown.requested() => return,
            }
            wait = (wait * 2).min(ENQUEUE_RETRY_MAX);
        }
    }
}
