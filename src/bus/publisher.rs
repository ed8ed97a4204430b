//! The outbox publisher: sends committed key-change events to `KEY_CHANGE`
//! with `Nats-Msg-Id = <instance id>-<outbox row id>-<index>`, then deletes
//! the row. A crash before the delete re-sends the same ids, which the
//! stream's duplicate window drops: nothing is lost and nothing is delivered
//! twice.
//!
//! Batches normally arrive in memory, straight from the transaction that
//! recorded them (no read-back). The table is read in id order at start, after
//! any failure, and every few seconds, to pick up rows left by a crash or by
//! another replica. While a failure is being recovered, batches in memory are
//! dropped (their rows are in the table), so events never overtake each other.

use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::BusError;
use crate::faults::{Fault, Faults};
use crate::metrics::Metrics;
use crate::store::Store;
use crate::store::outbox::{OutboxBatch, OutboxEvent};

/// Publishes awaiting their ack at most, well below async-nats' limit.
const ACKS_IN_FLIGHT: usize = 1024;
/// Rows read from the table per round.
const ROUND: u64 = 100;
/// Committed batches that may wait in memory before writers wait.
const QUEUE: usize = 256;
/// Most queued batches published in one round.
const MAX_BATCHES_PER_ROUND: usize = 256;
/// How often the table is read even when nothing failed.
const REREAD_EVERY: Duration = Duration::from_secs(5);
/// Longest pause between tries after a failure. A try is one read of the
/// table and publishes that fail at once while `KEY_CHANGE` has no leader
/// (no responders), so a short cap costs little and lets publishing resume
/// within a second of a new leader (measured in tests/cluster.rs: with 5 s,
/// up to 3 s passed between the leader's return and the next try).
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Why events could not be published (they stay in the table).
#[derive(Debug, thiserror::Error)]
pub enum OutboxError {
    /// Reading or deleting rows.
    #[error("database: {0}")]
    Database(#[from] sea_orm::DbErr),
    /// Publishing or its ack.
    #[error(transparent)]
    Bus(#[from] BusError),
}

/// Hands committed batches to the publisher. The publisher stops (after a
/// last re-read of the table) once every handle is dropped.
#[derive(Clone)]
pub struct OutboxHandle {
    queue: mpsc::Sender<OutboxBatch>,
}

impl OutboxHandle {
    /// Queues a just-committed batch for publishing. If the publisher is gone
    /// the rows stay in the table for the next start.
    pub async fn committed(&self, batch: OutboxBatch) {
        let _ = self.queue.send(batch).await;
    }
}

/// Publishes the outbox.
pub struct Publisher {
    store: Store,
    js: Context,
    instance_id: Arc<str>,
    queue: mpsc::Receiver<OutboxBatch>,
    faults: Faults,
    metrics: Metrics,
}

impl Publisher {
    /// A publisher for `store`'s outbox and the handle that feeds it.
    pub fn new(
        store: Store,
        js: Context,
        instance_id: String,
        faults: Faults,
        metrics: Metrics,
    ) -> (Publisher, OutboxHandle) {
        let (tx, rx) = mpsc::channel(QUEUE);
        let publisher = Publisher {
            store,
            js,
            instance_id: instance_id.into(),
            queue: rx,
            faults,
            metrics,
        };
        (publisher, OutboxHandle { queue: tx })
    }

    /// Runs until every [`OutboxHandle`] is dropped, then re-reads the table once
    /// more.
    pub async fn run(mut self) {
        let mut must_reread = true;
        let mut pause = Duration::from_millis(100);
        let mut last_reread = Instant::now();
        loop {
            if must_reread || last_reread.elapsed() >= REREAD_EVERY {
                // Queued batches are in the table too; dropping them keeps
                // the order of the table.
                while self.queue.try_recv().is_ok() {}
                last_reread = Instant::now();
                match self.reread_table().await {
                    Ok(_) => {
                        must_reread = false;
                        pause = Duration::from_millis(100);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "outbox publish failed; retrying");
                        if self.queue.is_closed() && self.queue.is_empty() {
                            break;
                        }
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(MAX_RETRY_PAUSE);
                        continue;
                    }
                }
            }
            tokio::select! {
                batch = self.queue.recv() => match batch {
                    Some(batch) => {
                        // Take whatever else is queued too: many small
                        // batches (one per fetched user) share one round
                        // of acks and one delete.
                        let mut batches = vec![batch];
                        while batches.len() < MAX_BATCHES_PER_ROUND {
                            match self.queue.try_recv() {
                                Ok(more) => batches.push(more),
                                Err(_) => break,
                            }
                        }
                        if let Err(e) = self.publish(&batches).await {
                            tracing::warn!(error = %e, "outbox publish failed; reading the table");
                            must_reread = true;
                        }
                    }
                    None => break,
                },
                () = tokio::time::sleep_until(last_reread + REREAD_EVERY) => {}
            }
        }
        if let Err(e) = self.reread_table().await {
            tracing::warn!(error = %e, "final outbox re-read failed; events stay for the next start");
        }
    }

    /// Publishes every row of the table in id order; returns how many events
    /// were sent.
    pub async fn reread_table(&self) -> Result<usize, OutboxError> {
        let mut sent = 0;
        let mut after = 0;
        loop {
            let batches = self.store.outbox_pending(after, ROUND).await?;
            let Some(last) = batches.last() else {
                return Ok(sent);
            };
            after = last.id;
            sent += self.publish(&batches).await?;
        }
    }

    /// Publishes batches in order, waits for the stream's acks, deletes
    /// their rows.
    async fn publish(&self, batches: &[OutboxBatch]) -> Result<usize, OutboxError> {
        let mut acks = Vec::with_capacity(ACKS_IN_FLIGHT);
        let mut sent = 0;
        // Collected first: a lazy iterator held across awaits trips the
        // compiler's Send check for the spawned task.
        let mut events: Vec<(i64, usize, &OutboxEvent)> = Vec::new();
        for batch in batches {
            for (index, event) in batch.events.iter().enumerate() {
                events.push((batch.id, index, event));
            }
        }
        for (id, index, event) in events {
            let mut headers = HeaderMap::new();
            headers.insert("user_id", event.user_id.as_str());
            headers.insert(
                async_nats::header::NATS_MESSAGE_ID,
                format!("{}-{id}-{index}", self.instance_id).as_str(),
            );
            let ack = self
                .js
                .publish_with_headers(event.subject.clone(), headers, event.payload.clone().into())
                .await
                .map_err(BusError::jetstream("cannot publish a key change"))?;
            acks.push(ack);
            sent += 1;
            // async-nats lends each publish a permit (5,000 in all) until
            // its ack future is awaited: holding more than that unawaited
            // blocks the next publish forever. A re-read after an outage
            // easily has more (found by tests/faults.rs).
            if acks.len() == ACKS_IN_FLIGHT {
                for ack in acks.drain(..) {
                    ack.await.map_err(not_stored)?;
                }
            }
        }
        for ack in acks {
            ack.await.map_err(not_stored)?;
        }
        self.faults.crash_point(Fault::CrashAfterPublish);
        let now = std::time::SystemTime::now();
        for batch in batches {
            let (source, since): (_, &[std::time::SystemTime]) = match &batch.origin {
                Some(origin) => (origin.source, &origin.since),
                None => ("table", &[]),
            };
            let seconds = since
                .iter()
                .filter_map(|at| now.duration_since(*at).ok())
                .map(|d| d.as_secs_f64());
            self.metrics.published(batch.events.len(), source, seconds);
        }
        let ids: Vec<i64> = batches.iter().map(|b| b.id).collect();
        self.store.outbox_delete(&ids).await?;
        Ok(sent)
    }
}

/// A key change `KEY_CHANGE` did not acknowledge.
fn not_stored(e: async_nats::jetstream::context::PublishError) -> BusError {
    BusError::jetstream("a key change was not stored")(e)
}
