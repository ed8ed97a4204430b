//! How a job ends (SPEC §5.2): taken out of the stream when its work is
//! done, then the server's next job enqueued if work was queued while it
//! ran; or given back with a delay (parked, the server backing off, our
//! own failure, stopping).

use std::time::Duration;

use async_nats::jetstream::{AckKind, Message};
use ruma::OwnedServerName;

use super::{Fetcher, JobEnd, LOCAL_RETRY, PULL_EXPIRY};
use crate::bus::{BusError, fetch_jobs};
use crate::faults::Fault;
use crate::shutdown::Shutdown;
use crate::store::now_ms;

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
                self.finish(message, shutdown).await;
                // Work queued while this job was in hand could not enqueue
                // a second job for the server: it is looked for now that
                // the job is out of the stream ([`super::follow_up`]).
                self.follow_ups.after(server).await;
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

    /// Takes the finished job out of the stream ([`fetch_jobs::finish`]),
    /// retried until it is out: until then the server's next job would be
    /// refused as a duplicate. On shutdown it is left to the consumer (it
    /// runs again, finding nothing left, or the start-up rescan finds the
    /// work).
    async fn finish(&self, message: &Message, shutdown: &Shutdown) {
        // Injected, the first try's reply is lost.
        let mut lose_reply = self.faults.is_armed(Fault::LoseJobAckReply);
        shutdown
            .retry("take out a finished fetch job", || {
                self.finish_once(message, std::mem::take(&mut lose_reply))
            })
            .await;
    }

    /// One try of [`Fetcher::finish`]; `lose_reply`: report it failed.
    async fn finish_once(&self, message: &Message, lose_reply: bool) -> Result<(), BusError> {
        fetch_jobs::finish(&self.js, message).await?;
        if lose_reply {
            return Err(BusError::NotApplied(
                "fault injection: the reply of the job's removal was lost".into(),
            ));
        }
        Ok(())
    }
}
