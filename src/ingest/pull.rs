//! Pull requests on the input consumer, and telling a pull that lost
//! messages on the way from one that completed: what a lost pull sent comes
//! back only after the ack wait, and newer messages must not overtake it.

use std::time::Duration;

use async_nats::jetstream::Message;
use async_nats::jetstream::consumer::PullConsumer;

use super::Ingest;
use super::pipeline::{Pipeline, gather};
use super::route::Router;
use crate::bus::Pulled;
use crate::bus::lease::Lease;
use crate::fetch::give_way::Behind;
use crate::shutdown::Shutdown;

/// How long one pull waits for messages (also the longest a clean stop waits).
const PULL_EXPIRY: Duration = Duration::from_secs(1);

/// Where a pull's messages go.
pub(super) enum Sink<'a> {
    /// Applied here, two batches in flight.
    Apply(&'a mut Pipeline),
    /// Routed to their partitions while the lease holds.
    Route(&'a mut Router, &'a Lease),
}

impl Sink<'_> {
    /// The pipeline batches gather against (the router's is never busy:
    /// a chunk is routed before the next is gathered).
    fn pipeline(&mut self) -> &mut Pipeline {
        match self {
            Sink::Apply(pipeline) => pipeline,
            Sink::Route(router, _) => &mut router.idle,
        }
    }
}

/// How a pull request ended.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum PullEnd {
    /// Complete, or refused before it started.
    Over,
    /// Vanished or broken: some of what it sent may never have arrived.
    Lost,
}

impl Ingest {
    /// After taking over, waits (at most `ack_wait`) until no message is
    /// delivered-but-unacked: a crashed leader's messages are then redelivered
    /// before newer ones, which keeps per-user order. Tells the fan-out
    /// whether a backlog waits.
    pub(super) async fn wait_for_in_flight(
        &self,
        consumer: &PullConsumer,
        shutdown: &Shutdown,
        behind: &mut Option<Behind>,
    ) {
        let deadline = tokio::time::Instant::now() + self.ack_wait + Duration::from_secs(1);
        let mut consumer = consumer.clone();
        while tokio::time::Instant::now() < deadline && !shutdown.is_requested() {
            match consumer.info().await {
                Ok(info) => {
                    let waiting = usize::try_from(info.num_pending)
                        .unwrap_or(usize::MAX)
                        .saturating_add(info.num_ack_pending);
                    *behind = self.backlog.note_batch(waiting >= self.batch_size);
                    if info.num_ack_pending == 0 {
                        return;
                    }
                }
                Err(_) => *behind = None,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// One pull request: hands what it delivers to `sink`, in chunks as
    /// it arrives, until it is complete or expires, and says how it ended.
    /// Applied, the last chunk may still be in flight when this returns, so
    /// the next pull overlaps it; the caller finishes the pipeline before it
    /// lets go of the stream. Routed, a chunk that could not be routed is
    /// given back and the pull counts as lost (what it still held must not
    /// overtake the chunk).
    pub(super) async fn pull_once(
        &self,
        consumer: &PullConsumer,
        shutdown: &Shutdown,
        sink: &mut Sink<'_>,
        behind: &mut Option<Behind>,
    ) -> PullEnd {
        let connects = self.connects();
        let Some(mut pull) =
            crate::bus::start_pull(consumer, self.batch_size, PULL_EXPIRY, "input").await
        else {
            return PullEnd::Over;
        };
        let mut delivered = false;
        loop {
            let first = match crate::bus::next_or_lost(&mut pull, PULL_EXPIRY).await {
                Pulled::Item(Ok(message)) => message,
                Pulled::Item(Err(e)) => {
                    // A broken pull may have lost messages on the way, as a
                    // vanished one does.
                    tracing::info!(error = %e, "input pull ended with an error");
                    return PullEnd::Lost;
                }
                // A pull across a reconnect may have lost messages on the
                // way even when it ends as if complete: async-nats ends a
                // pull the server forgot on a timer of its own (the expiry
                // plus 5 s from the pull's start), which can come before
                // `next_or_lost` gives up (found by `tests/faults.rs`,
                // NATS restarted during a burst).
                Pulled::Over if self.connects() != connects => return PullEnd::Lost,
                Pulled::Over => {
                    if !delivered {
                        // Nothing came within the expiry: caught up.
                        *behind = None;
                        self.backlog.note_idle();
                    }
                    return PullEnd::Over;
                }
                Pulled::Lost => return PullEnd::Lost,
            };
            let chunk = gather(first, &mut pull, self.batch_size, sink.pipeline()).await;
            if self.connects() != connects {
                // The client reconnected during this pull while the server
                // still held it (its expiry had not come): what it delivers
                // now may be newer than what it lost on the old connection.
                // Left unacked, the chunk comes back after the ack wait,
                // behind what was lost (per-user order; found by
                // `tests/faults.rs` `a_lost_pull_keeps_per_user_order`).
                tracing::info!(
                    messages = chunk.len(),
                    "input pull crossed a reconnect; its messages wait for redelivery"
                );
                return PullEnd::Lost;
            }
            delivered = true;
            *behind = self.backlog.note_batch(self.behind(&chunk));
            match sink {
                Sink::Apply(pipeline) => pipeline.push(self, chunk, shutdown).await,
                Sink::Route(router, lease) => {
                    if !self.route(router, chunk, lease).await {
                        return PullEnd::Lost;
                    }
                }
            }
        }
    }

    /// How many times the NATS client has connected so far (reconnects
    /// included).
    fn connects(&self) -> u64 {
        self.js
            .client()
            .statistics()
            .connects
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether more input waits than one batch holds: the batch is full, or
    /// JetStream's count of messages pending after its last one (carried in
    /// every delivery's reply subject) is a batch or more.
    fn behind(&self, chunk: &[Message]) -> bool {
        chunk.len() >= self.batch_size
            || chunk
                .last()
                .and_then(|m| m.info().ok())
                .is_some_and(|info| {
                    usize::try_from(info.pending).unwrap_or(usize::MAX) >= self.batch_size
                })
    }
}
