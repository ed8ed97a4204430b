//! Writing a batch: one transaction in its turn normally; held while the
//! database is down; one message at a time when the database refuses the
//! batch, so only the message it refuses is dead-lettered.

use std::collections::BTreeSet;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use ruma::OwnedServerName;
use tokio::sync::oneshot;

use super::Ingest;
use super::check::Item;
use crate::faults::Fault;
use crate::input::{DeadReason, InputMessage};
use crate::shutdown::Shutdown;
use crate::store::{Applied, Turn, now_ms};

/// Tries of a whole batch while the database answers before messages are
/// applied one by one to find the one it refuses.
const BATCH_TRIES: u32 = 3;

/// What a batch's writes did: its plans (one for the batch, or one per
/// message when applied one by one), and for each outcome of those plans in
/// order, the place in the batch's accepted messages of the one it is about.
#[derive(Default)]
pub(super) struct BatchWrites {
    /// The plans written and their outbox batches.
    pub(super) applied: Vec<Applied>,
    /// Per outcome, its message's place in the accepted messages.
    pub(super) covers: Vec<usize>,
}

impl Ingest {
    /// Writes the accepted messages: as one transaction normally, in `turn`
    /// after the previous batch; while the database is down, waits (keeping
    /// the messages with progress acks); when the database answers but
    /// refuses the batch, applies messages one by one and dead-letters the
    /// ones it refuses. Any try after the first waits until the previous
    /// batch is done, so it cannot overtake it. None: shutting down.
    pub(super) async fn apply(
        &self,
        items: &[Item],
        accepted: &[(usize, &InputMessage)],
        shutdown: &Shutdown,
        turn: Turn,
        previous_done: &mut Option<oneshot::Receiver<()>>,
    ) -> Option<BatchWrites> {
        let messages: Vec<InputMessage> = accepted.iter().map(|(_, m)| (*m).clone()).collect();
        let whole = |applied| BatchWrites {
            applied: vec![applied],
            covers: (0..accepted.len()).collect(),
        };
        if messages.is_empty() {
            turn.pass().await;
            return Some(BatchWrites::default());
        }
        match self
            .store
            .apply_batch_in_turn(&messages, now_ms(), turn)
            .await
        {
            Ok(Some(applied)) => {
                self.crash_point();
                return Some(whole(applied));
            }
            Ok(None) => tracing::debug!("previous batch failed; retrying after it"),
            Err(e) => tracing::debug!(error = %e, "batch failed; retrying after the previous one"),
        }
        if let Some(previous) = previous_done.take() {
            let _ = previous.await;
        }
        let mut refused = 0;
        let mut wait = Duration::from_millis(100);
        loop {
            match self.store.apply_batch(&messages, now_ms()).await {
                Ok(applied) => {
                    self.crash_point();
                    return Some(whole(applied));
                }
                Err(e) if self.store.ping().await => {
                    refused += 1;
                    tracing::warn!(error = %e, tries = refused, "database refused the batch");
                    if refused >= BATCH_TRIES {
                        return self.apply_one_by_one(items, accepted).await;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "database unavailable; holding the batch"),
            }
            if shutdown.is_requested() {
                return None;
            }
            for item in items {
                let _ = item.message.ack_with(AckKind::Progress).await;
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(5));
        }
    }

    /// Applies the accepted messages one at a time and dead-letters each one
    /// the database refuses on its own. None: the database stopped answering
    /// or a dead letter was not stored.
    async fn apply_one_by_one(
        &self,
        items: &[Item],
        accepted: &[(usize, &InputMessage)],
    ) -> Option<BatchWrites> {
        let mut done = BatchWrites::default();
        for (position, &(index, message)) in accepted.iter().enumerate() {
            let mut last_error = String::new();
            let mut applied = false;
            for _ in 0..BATCH_TRIES {
                match self
                    .store
                    .apply_batch(std::slice::from_ref(message), now_ms())
                    .await
                {
                    Ok(one) => {
                        self.crash_point();
                        done.applied.push(one);
                        done.covers.push(position);
                        applied = true;
                        break;
                    }
                    Err(e) => last_error = e.to_string(),
                }
            }
            if !applied {
                if !self.store.ping().await {
                    return None;
                }
                let error = format!("the database refused it: {last_error}");
                let message = &items[index].message;
                self.store_dead_letter(message, DeadReason::Unprocessable, error)
                    .await?;
            }
        }
        Some(done)
    }

    /// Hands the servers of the batch's stale users to the fetch queue,
    /// retrying until it takes them; false if shutting down first.
    pub(super) async fn enqueue_jobs(
        &self,
        servers: &BTreeSet<OwnedServerName>,
        shutdown: &Shutdown,
    ) -> bool {
        loop {
            match self.queue.stale(servers).await {
                Ok(()) => return true,
                Err(e) => tracing::warn!(error = %e, "fetch jobs not enqueued; retrying"),
            }
            if shutdown.is_requested() {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Where a crash test stops the process: committed, nothing acked.
    fn crash_point(&self) {
        self.faults.crash_point(Fault::CrashAfterCommit);
    }
}
