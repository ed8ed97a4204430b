//! One batch from its messages to its acks: check each message, store the
//! dead letters, write the rest ([`super::apply`]), then, in the batch's
//! order, hand over fetch jobs, wake-ups, sweeps and key-change events, and
//! ack. Every message is acked or naked when a batch ends.

use std::collections::BTreeSet;
use std::time::{Duration, UNIX_EPOCH};

use async_nats::jetstream::{AckKind, Message};
use ruma::OwnedServerName;

use super::Ingest;
use super::apply::BatchWrites;
use super::check::Item;
use super::pipeline::Order;
use crate::input::{InputMessage, Parsed};
use crate::shutdown::Shutdown;
use crate::store::Applied;
use crate::store::outbox::Origin;

impl Ingest {
    /// Processes one batch; every message is acked or naked when this returns.
    /// `order` places it after the batch before it (see
    /// [`super::pipeline::Pipeline`]).
    pub(super) async fn process(&self, batch: Vec<Message>, shutdown: &Shutdown, order: Order) {
        let Order {
            turn,
            mut previous_done,
            done,
        } = order;
        let started = std::time::Instant::now();
        let size = batch.len();
        let items: Vec<Item> = batch
            .into_iter()
            .map(|message| self.check(message))
            .collect();
        if let Err(e) = self.dead_letter_rejected(&items).await {
            // Dropping `order` tells the next batch this one gave up.
            tracing::warn!(error = %e, "dead letters not stored; batch will be redelivered");
            nak_all(&items, Some(Duration::from_secs(1))).await;
            return;
        }
        let accepted: Vec<(usize, &InputMessage)> = items
            .iter()
            .enumerate()
            .filter_map(|(i, item)| match &item.verdict {
                Ok(Parsed::Accept(m)) => Some((i, m)),
                _ => None,
            })
            .collect();
        record_users(&accepted);
        let written = self
            .apply(&items, &accepted, shutdown, turn, &mut previous_done)
            .await;
        // Finish in order: acks and events of a batch never overtake those
        // of the batch before it.
        if let Some(previous) = previous_done.take() {
            let _ = previous.await;
        }
        let Some(written) = written else {
            nak_all(&items, None).await;
            return;
        };
        if !self
            .after_commit(&items, &accepted, &written, shutdown)
            .await
        {
            nak_all(&items, None).await;
            return;
        }
        self.hand_over_events(&items, &accepted, written).await;
        let applied = started.elapsed();
        for item in &items {
            if let Err(e) = item.message.ack().await {
                tracing::warn!(error = %e, "ack failed; the message will be redelivered (a no-op)");
            }
        }
        let _ = done.send(());
        tracing::debug!(
            messages = size,
            apply_ms = applied.as_secs_f64() * 1000.0,
            total_ms = started.elapsed().as_secs_f64() * 1000.0,
            "batch processed"
        );
    }

    /// What follows a commit before the acks: fetch jobs for the stale
    /// users, wake-up checks, metrics, sweeps, and the link conflicts' dead
    /// letters. False: the batch goes back for redelivery (its writes are
    /// committed, and redelivery is a no-op).
    async fn after_commit(
        &self,
        items: &[Item],
        accepted: &[(usize, &InputMessage)],
        written: &BatchWrites,
        shutdown: &Shutdown,
    ) -> bool {
        let servers: BTreeSet<OwnedServerName> = written
            .applied
            .iter()
            .flat_map(|a| a.plan.fetch_servers.iter().cloned())
            .collect();
        if !servers.is_empty() && !self.enqueue_jobs(&servers, shutdown).await {
            // Stale marks are committed; a restart rescans them.
            return false;
        }
        // Input from a server in back-off shows it is up (SPEC §5.2):
        // checked in the background, after the batch committed.
        if let Some(wakeups) = self.queue.wakeups() {
            wakeups.note_all(accepted.iter().filter_map(|(_, m)| {
                m.user_id()
                    .filter(|_| m.heard_from_server())
                    .map(|user| (user.server_name(), true))
            }));
        }
        self.count_outcomes(&written.applied);
        // Applied, but a link conflict not dead-lettered: redelivery finds
        // the link applied and the conflict again (a no-op else).
        self.dead_letter_conflicts(items, accepted, &written.applied, &written.covers)
            .await
            .is_some()
    }

    /// Counts the outcomes and untracked users, and wakes the sweeper if a
    /// room became ours or stopped being ours.
    fn count_outcomes(&self, applied: &[Applied]) {
        let mut sweeps = false;
        for applied in applied {
            for outcome in &applied.plan.outcomes {
                if outcome.is_room_outcome() {
                    self.metrics.membership_change(outcome.as_str());
                } else {
                    self.metrics.update(outcome.as_str());
                }
            }
            self.metrics.untracked(applied.plan.rooms.untrack.len());
            sweeps |= applied.plan.rooms.rooms.values().any(|room| room.sweep);
        }
        if sweeps {
            self.sweeps.notify_one();
        }
    }

    /// Hands each plan's key-change events to the outbox publisher, timed
    /// from the input messages they cover.
    async fn hand_over_events(
        &self,
        items: &[Item],
        accepted: &[(usize, &InputMessage)],
        written: BatchWrites,
    ) {
        let mut covered = written.covers.iter();
        for applied in written.applied {
            let messages: Vec<&Message> = covered
                .by_ref()
                .take(applied.plan.outcomes.len())
                .map(|&position| &items[accepted[position].0].message)
                .collect();
            if let Some(mut batch) = applied.outbox {
                batch.origin = Some(Origin {
                    source: "update",
                    since: messages.into_iter().filter_map(entered_jetstream).collect(),
                });
                self.outbox.committed(batch).await;
            }
        }
    }
}

/// Records on the batch's span how many users it names and the first of
/// them (to find a user's batch in a trace search).
fn record_users(accepted: &[(usize, &InputMessage)]) {
    let span = tracing::Span::current();
    if span.is_disabled() {
        return;
    }
    let users: BTreeSet<&str> = accepted
        .iter()
        .filter_map(|(_, m)| m.user_id().map(ruma::UserId::as_str))
        .collect();
    span.record("users", users.len());
    if let Some(first) = users.first() {
        span.record("user", *first);
    }
}

/// When `message` entered JetStream.
fn entered_jetstream(message: &Message) -> Option<std::time::SystemTime> {
    let nanos = message.info().ok()?.published.unix_timestamp_nanos();
    u64::try_from(nanos)
        .ok()
        .map(|nanos| UNIX_EPOCH + Duration::from_nanos(nanos))
}

/// Gives every message of a batch back for redelivery (after `delay`).
pub(super) async fn nak_all(items: &[Item], delay: Option<Duration>) {
    for item in items {
        let _ = item.message.ack_with(AckKind::Nak(delay)).await;
    }
}
