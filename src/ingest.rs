//! Ingest: the batch loop. Pull a batch → check each message (dead letters
//! out) → plan and write it in one transaction → enqueue fetch jobs → wake
//! the outbox publisher → ack. Acks come last, so a crash at any point means
//! redelivery, and redelivered updates are no-ops (SPEC §5.1.4).

use std::time::{Duration, UNIX_EPOCH};

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{AckKind, Context, Message};
use futures::StreamExt as _;
use ruma::OwnedServerName;
use tokio::sync::oneshot;

use crate::shutdown::Shutdown;
use tracing::Instrument as _;

use crate::bus::dead_letters::{self, DeadLetter};
use crate::bus::lease::Lease;
use crate::bus::publisher::OutboxHandle;
use crate::bus::{BusError, Pulled};
use crate::decide::Outcome;
use crate::faults::{Fault, Faults};
use crate::fetch::give_way::Behind;
use crate::input::{self, DeadReason, InputMessage, InputSubjects, Parsed, Rejection};
use crate::store::outbox::Origin;
use crate::store::{Applied, Baton, Store, Turn};

/// How long one pull waits for messages (also the longest a clean stop waits).
const PULL_EXPIRY: Duration = Duration::from_secs(1);
/// While no batch is in flight, how long a batch may gather what follows its
/// first message before it starts (a burst's messages arrive back to back).
const LINGER: Duration = Duration::from_millis(2);
/// Tries of a whole batch while the database answers before messages are
/// applied one by one to find the one it refuses.
const BATCH_TRIES: u32 = 3;

/// The ingest loop of one input stream.
#[derive(Clone)]
pub struct Ingest {
    /// JetStream.
    pub js: Context,
    /// The database.
    pub store: Store,
    /// Our server: its users are ignored.
    pub own_server: OwnedServerName,
    /// Which subject carries which input.
    pub subjects: InputSubjects,
    /// Messages per batch.
    pub batch_size: usize,
    /// Deliveries before a message is dead-lettered.
    pub max_deliver: i64,
    /// Takes committed events to the outbox publisher.
    pub outbox: OutboxHandle,
    /// Fault injection for crash tests.
    pub faults: Faults,
    /// The lease bucket: one replica consumes a stream at a time.
    pub leases: async_nats::jetstream::kv::Store,
    /// Lease length.
    pub lease_ttl: Duration,
    /// The input consumer's ack wait.
    pub ack_wait: Duration,
    /// Counters and histograms.
    pub metrics: crate::metrics::Metrics,
    /// Where servers with users newly stale or newly tracked go (SPEC
    /// §5.2), and input from a server may end its job's back-off.
    pub queue: crate::fetch::queue::FetchQueue,
    /// `DLU_MEMBERSHIP=on`: room input is read (SPEC §5.5).
    pub membership: bool,
    /// `DLU_MSC4430=on`: member keys are identities (SPEC §5.6).
    pub member_keys: bool,
    /// Told when a batch leaves a room to sweep.
    pub sweeps: std::sync::Arc<tokio::sync::Notify>,
    /// Told after each batch whether ingest is behind (see `behind`), so
    /// the fan-out gives way meanwhile.
    pub backlog: crate::fetch::give_way::IngestBacklog,
}

/// How a pull request ended.
#[derive(Debug, PartialEq, Eq)]
enum PullEnd {
    /// Complete, or refused before it started.
    Over,
    /// Vanished or broken: some of what it sent may never have arrived.
    Lost,
}

/// What a batch's writes did: its plans (one for the batch, or one per
/// message when applied one by one), and for each outcome of those plans in
/// order, the place in the batch's accepted messages of the one it is about.
#[derive(Default)]
struct Written {
    applied: Vec<Applied>,
    covers: Vec<usize>,
}

/// One message of a batch and what the checks made of it.
struct Item {
    message: Message,
    verdict: Result<Parsed, Rejection>,
}

use crate::store::now_ms;

impl Ingest {
    /// Consumes `consumer` while this replica holds the stream's lease, until
    /// `shutdown` turns true.
    pub async fn run(self, stream_name: String, consumer: PullConsumer, shutdown: Shutdown) {
        let key = format!("input.{stream_name}");
        let holder = uuid::Uuid::new_v4().to_string();
        while !shutdown.is_requested() {
            let Some(lease) = Lease::try_acquire(&self.leases, &key, &holder, self.lease_ttl).await
            else {
                // Another replica consumes the input: this one's fan-out has
                // no ingest to give way to.
                self.backlog.note_idle();
                tokio::select! {
                    () = tokio::time::sleep(self.lease_ttl / 4) => {}
                    () = shutdown.requested() => {}
                }
                continue;
            };
            tracing::info!(stream = %stream_name, "this replica now consumes the input stream");
            // Whether ingest is behind, from the last batch or count seen
            // until the next: the fan-out gives way meanwhile.
            let mut behind = None;
            self.wait_for_in_flight(&consumer, &shutdown, &mut behind)
                .await;
            let mut pipeline = Pipeline::default();
            while !shutdown.is_requested() && !lease.is_lost() {
                let end = self
                    .pull_once(&consumer, &shutdown, &mut pipeline, &mut behind)
                    .await;
                if end == PullEnd::Lost {
                    // What the lost pull sent and we never read comes back
                    // only after the ack wait; newer messages must not
                    // overtake it (per-user order), as after a takeover.
                    pipeline.finish().await;
                    self.wait_for_in_flight(&consumer, &shutdown, &mut behind)
                        .await;
                }
            }
            drop(behind);
            pipeline.finish().await;
            lease.release().await;
        }
    }

    /// After taking over, waits (at most `ack_wait`) until no message is
    /// delivered-but-unacked: a crashed leader's messages are then redelivered
    /// before newer ones, which keeps per-user order. Tells the fan-out
    /// whether a backlog waits.
    async fn wait_for_in_flight(
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

    /// One pull request: hands what it delivers to `pipeline`, in chunks as
    /// it arrives, until it is complete or expires, and says how it ended. The last chunk may still
    /// be in flight when this returns, so the next pull overlaps it; the
    /// caller finishes the pipeline before it lets go of the stream.
    async fn pull_once(
        &self,
        consumer: &PullConsumer,
        shutdown: &Shutdown,
        pipeline: &mut Pipeline,
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
            let chunk = gather(first, &mut pull, self.batch_size, pipeline).await;
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
            pipeline.push(self, chunk, shutdown).await;
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

    /// Processes one batch; every message is acked or naked when this returns.
    /// `order` places it after the batch before it (see [`Pipeline`]).
    async fn process(&self, batch: Vec<Message>, shutdown: &Shutdown, order: Order) {
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
            nak_all(
                items.iter().map(|i| &i.message),
                Some(Duration::from_secs(1)),
            )
            .await;
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
        let span = tracing::Span::current();
        if !span.is_disabled() {
            let users: std::collections::BTreeSet<&str> = accepted
                .iter()
                .filter_map(|(_, m)| m.user_id().map(ruma::UserId::as_str))
                .collect();
            span.record("users", users.len());
            if let Some(first) = users.first() {
                span.record("user", *first);
            }
        }
        let applied = self
            .apply(&items, &accepted, shutdown, turn, &mut previous_done)
            .await;
        // Finish in order: acks and events of a batch never overtake those
        // of the batch before it.
        if let Some(previous) = previous_done.take() {
            let _ = previous.await;
        }
        let Some(Written { applied, covers }) = applied else {
            nak_all(items.iter().map(|i| &i.message), None).await;
            return;
        };
        let servers: std::collections::BTreeSet<OwnedServerName> = applied
            .iter()
            .flat_map(|a| a.plan.fetch_servers.iter().cloned())
            .collect();
        if !servers.is_empty() && !self.enqueue_jobs(&servers, shutdown).await {
            // Stale marks are committed; a restart rescans them.
            nak_all(items.iter().map(|i| &i.message), None).await;
            return;
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
        let mut sweeps = false;
        for applied in &applied {
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
        if !self
            .dead_letter_conflicts(&items, &accepted, &applied, &covers)
            .await
        {
            // Applied, but a link conflict was not dead-lettered: redelivery
            // finds the link applied and the conflict again (a no-op else).
            nak_all(items.iter().map(|i| &i.message), None).await;
            return;
        }
        // Each batch of events is timed from the input messages it covers.
        let mut covered = covers.iter();
        for applied in applied {
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

    fn check(&self, message: Message) -> Item {
        let delivered = message.info().map(|i| i.delivered).unwrap_or(1);
        let verdict = if delivered >= self.max_deliver && self.max_deliver > 1 {
            Err(Rejection::new(
                DeadReason::MaxDeliver,
                format!("delivered {delivered} times without being processed"),
            ))
        } else {
            match self.subjects.kind_of(message.subject.as_str()) {
                None => Err(Rejection::new(
                    DeadReason::UnknownSubject,
                    format!("no input is configured on subject {}", message.subject),
                )),
                Some(kind) => {
                    let origin = message
                        .headers
                        .as_ref()
                        .and_then(|h| h.get("origin"))
                        .map(|v| v.as_str());
                    let rules = input::Rules {
                        own_server: &self.own_server,
                        membership: self.membership,
                        member_keys: self.member_keys,
                    };
                    input::parse(kind, &message.payload, origin, &rules)
                }
            }
        };
        if let Ok(Parsed::Accept(InputMessage::SigningKey(keys))) = &verdict
            && !keys.dropped.is_empty()
        {
            tracing::warn!(user_id = %keys.user_id, dropped = ?keys.dropped, "ignored malformed cross-signing keys");
        }
        Item { message, verdict }
    }

    async fn dead_letter_rejected(&self, items: &[Item]) -> Result<(), BusError> {
        let mut acks = Vec::new();
        for item in items {
            if let Err(rejection) = &item.verdict {
                acks.push(self.dead_letter(&item.message, rejection).await?);
            }
        }
        for ack in acks {
            ack.await
                .map_err(BusError::jetstream("a dead letter was not stored"))?;
        }
        Ok(())
    }

    /// Dead-letters the link changes the planner refused as conflicts
    /// (SPEC §5.6.2). They are only known after planning, so they go after
    /// the commit; false if one could not be stored. `covers` names, per
    /// outcome of `applied` in order, its message's place in `accepted`.
    async fn dead_letter_conflicts(
        &self,
        items: &[Item],
        accepted: &[(usize, &InputMessage)],
        applied: &[Applied],
        covers: &[usize],
    ) -> bool {
        // A plan has one outcome per message it was given.
        debug_assert_eq!(
            applied.iter().map(|a| a.plan.outcomes.len()).sum::<usize>(),
            covers.len()
        );
        let outcomes = applied.iter().flat_map(|a| a.plan.outcomes.iter().copied());
        for (outcome, &position) in outcomes.zip(covers) {
            if outcome != Outcome::LinkConflict {
                continue;
            }
            let (index, message) = accepted[position];
            let first = match message {
                InputMessage::MemberKey(link) => link.member_key.as_str(),
                _ => "",
            };
            let rejection = Rejection::new(
                DeadReason::LinkConflict,
                format!("member key {first} is already linked to another user in this room"),
            );
            let stored = match self.dead_letter(&items[index].message, &rejection).await {
                Ok(ack) => ack.await.is_ok(),
                Err(_) => false,
            };
            if !stored {
                return false;
            }
        }
        true
    }

    async fn dead_letter(
        &self,
        message: &Message,
        rejection: &Rejection,
    ) -> Result<async_nats::jetstream::context::PublishAckFuture, BusError> {
        tracing::info!(reason = %rejection.reason, error = %rejection.error, subject = %message.subject, "dead letter");
        self.metrics.dead_letter(rejection.reason.as_str());
        let origin_id = message
            .info()
            .map(|i| format!("{}:{}", i.stream, i.stream_sequence))
            .unwrap_or_else(|_| uuid::Uuid::new_v4().to_string());
        dead_letters::publish(
            &self.js,
            DeadLetter {
                reason: rejection.reason,
                error: &rejection.error,
                source_subject: message.subject.as_str(),
                headers: message.headers.as_ref(),
                body: message.payload.clone(),
                origin_id,
            },
        )
        .await
    }

    /// Writes the accepted messages: as one transaction normally, in `turn`
    /// after the previous batch; while the database is down, waits (keeping
    /// the messages with progress acks); when the database answers but
    /// refuses the batch, applies messages one by one and dead-letters the
    /// ones it refuses. Any try after the first waits until the previous
    /// batch is done, so it cannot overtake it. None: shutting down.
    async fn apply(
        &self,
        items: &[Item],
        accepted: &[(usize, &InputMessage)],
        shutdown: &Shutdown,
        turn: Turn,
        previous_done: &mut Option<oneshot::Receiver<()>>,
    ) -> Option<Written> {
        let messages: Vec<InputMessage> = accepted.iter().map(|(_, m)| (*m).clone()).collect();
        let whole = |applied| Written {
            applied: vec![applied],
            covers: (0..accepted.len()).collect(),
        };
        if messages.is_empty() {
            turn.pass().await;
            return Some(Written::default());
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

    async fn apply_one_by_one(
        &self,
        items: &[Item],
        accepted: &[(usize, &InputMessage)],
    ) -> Option<Written> {
        let mut done = Written::default();
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
                let rejection = Rejection::new(
                    DeadReason::Unprocessable,
                    format!("the database refused it: {last_error}"),
                );
                let stored = match self.dead_letter(&items[index].message, &rejection).await {
                    Ok(ack) => ack.await.is_ok(),
                    Err(_) => false,
                };
                if !stored {
                    return None;
                }
            }
        }
        Some(done)
    }

    async fn enqueue_jobs(
        &self,
        servers: &std::collections::BTreeSet<OwnedServerName>,
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

    fn crash_point(&self) {
        self.faults.crash_point(Fault::CrashAfterCommit);
    }
}

/// When `message` entered JetStream.
fn entered_jetstream(message: &Message) -> Option<std::time::SystemTime> {
    let nanos = message.info().ok()?.published.unix_timestamp_nanos();
    u64::try_from(nanos)
        .ok()
        .map(|nanos| UNIX_EPOCH + Duration::from_nanos(nanos))
}

/// A batch: `first` and what follows it, up to `max` messages. How long it
/// gathers adapts to the load, so a lone update goes through at once while
/// a burst still batches:
/// - while a batch is in flight, it gathers until that batch has finished
///   (it could not start sooner anyway) or it is full;
/// - while none is, it takes what arrives within [`LINGER`] of its first
///   message and goes.
///
/// Under a steady rate a batch therefore holds what arrived while the one
/// before it ran, not a fixed time's worth. A real await on the pull (not
/// `now_or_never`) matters: tokio's cooperative budget makes a bare poll
/// report "pending" after 128 receives, which would split batches into 128s.
async fn gather<T, E, S>(first: T, pull: &mut S, max: usize, pipeline: &mut Pipeline) -> Vec<T>
where
    S: futures::Stream<Item = Result<T, E>> + Unpin,
{
    let mut chunk = vec![first];
    let linger_until = tokio::time::Instant::now() + LINGER;
    while chunk.len() < max {
        let next = if pipeline.is_busy() {
            tokio::select! {
                biased;
                next = pull.next() => next,
                () = pipeline.idle() => break,
            }
        } else {
            match tokio::time::timeout_at(linger_until, pull.next()).await {
                Ok(next) => next,
                Err(_) => break,
            }
        };
        match next {
            Some(Ok(message)) => chunk.push(message),
            _ => break,
        }
    }
    chunk
}

/// A batch's place in the pipeline.
struct Order {
    /// Its database turn after the previous batch.
    turn: Turn,
    /// Resolves when the previous batch has finished (acked or naked).
    previous_done: Option<oneshot::Receiver<()>>,
    /// Told when this batch has finished.
    done: oneshot::Sender<()>,
}

/// Two batches in flight: while one commits, hands its events over and acks,
/// the next is checked, locked, loaded and written. Their order is kept
/// where it matters: user locks in batch order, commits in batch order (a
/// batch whose predecessor failed rolls back and tries again after it), and
/// acks and events in batch order.
#[derive(Default)]
struct Pipeline {
    in_flight: Option<tokio::task::JoinHandle<()>>,
    baton: Option<Baton>,
    done: Option<oneshot::Receiver<()>>,
}

impl Pipeline {
    /// Starts `batch` after the batches already pushed; returns once at
    /// most one batch (this one) is still in flight.
    async fn push(&mut self, ingest: &Ingest, batch: Vec<Message>, shutdown: &Shutdown) {
        let (turn, baton) = Turn::after(self.baton.take());
        let (done_tx, done_rx) = oneshot::channel();
        let order = Order {
            turn,
            previous_done: self.done.replace(done_rx),
            done: done_tx,
        };
        self.baton = Some(baton);
        let ingest = ingest.clone();
        let shutdown = shutdown.clone();
        // `users` and `user` (the first one, to find a user's batch in a
        // trace search) are recorded once the messages are parsed.
        let span = tracing::info_span!(
            "batch",
            messages = batch.len(),
            users = tracing::field::Empty,
            user = tracing::field::Empty,
        );
        let task = tokio::spawn(
            async move { ingest.process(batch, &shutdown, order).await }.instrument(span),
        );
        if let Some(previous) = self.in_flight.replace(task) {
            let _ = previous.await;
        }
    }

    /// Whether a pushed batch has not finished yet.
    fn is_busy(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Waits until the batch in flight has finished. Cancel-safe: a wait cut
    /// short leaves the batch in flight.
    async fn idle(&mut self) {
        if let Some(task) = &mut self.in_flight {
            let _ = task.await;
            self.in_flight = None;
        }
    }

    /// Waits until every pushed batch has finished.
    async fn finish(&mut self) {
        if let Some(last) = self.in_flight.take() {
            let _ = last.await;
        }
        self.baton = None;
        self.done = None;
    }
}

async fn nak_all<'a>(messages: impl Iterator<Item = &'a Message>, delay: Option<Duration>) {
    for message in messages {
        let _ = message.ack_with(AckKind::Nak(delay)).await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::StreamExt as _;
    use futures::channel::mpsc;
    use tokio::sync::oneshot;

    use super::{LINGER, Pipeline, gather};

    /// A pull whose messages the test sends.
    fn pull() -> (
        mpsc::UnboundedSender<u32>,
        impl futures::Stream<Item = Result<u32, ()>> + Unpin,
    ) {
        let (tx, rx) = mpsc::unbounded();
        (tx, rx.map(Ok))
    }

    /// A pipeline with a batch in flight until the sender is used or dropped.
    fn busy() -> (Pipeline, oneshot::Sender<()>) {
        let (tx, rx) = oneshot::channel::<()>();
        let pipeline = Pipeline {
            in_flight: Some(tokio::spawn(async move {
                let _ = rx.await;
            })),
            ..Pipeline::default()
        };
        (pipeline, tx)
    }

    /// Sends a message every `every` from a task.
    fn steady(tx: mpsc::UnboundedSender<u32>, every: Duration) {
        tokio::spawn(async move {
            for n in 1.. {
                tokio::time::sleep(every).await;
                if tx.unbounded_send(n).is_err() {
                    break;
                }
            }
        });
    }

    /// Nothing in flight and a steady trickle closer than [`LINGER`]: the
    /// batch still starts [`LINGER`] after its first message; it does not
    /// wait for a gap that never comes.
    #[tokio::test(start_paused = true)]
    async fn idle_starts_within_linger() {
        let (tx, mut pull) = pull();
        let mut pipeline = Pipeline::default();
        steady(tx, Duration::from_micros(500));
        let started = tokio::time::Instant::now();
        let batch = gather(0, &mut pull, 1000, &mut pipeline).await;
        assert!(started.elapsed() <= LINGER + Duration::from_millis(1));
        assert!(batch.len() <= 6, "{} messages", batch.len());
    }

    /// Nothing in flight and nothing else arriving: a lone update goes on
    /// alone.
    #[tokio::test(start_paused = true)]
    async fn lone_message_goes_alone() {
        let (_tx, mut pull) = pull();
        let mut pipeline = Pipeline::default();
        assert_eq!(gather(7, &mut pull, 1000, &mut pipeline).await, [7]);
    }

    /// A batch in flight: the next one gathers until it has finished (it
    /// could not start sooner), however long that is, then goes at once.
    #[tokio::test(start_paused = true)]
    async fn busy_gathers_until_the_batch_in_flight_ends() {
        let (tx, mut pull) = pull();
        let (mut pipeline, finish) = busy();
        steady(tx, Duration::from_millis(1));
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let _ = finish.send(());
        });
        let batch = gather(0, &mut pull, 1000, &mut pipeline).await;
        assert!((45..=55).contains(&batch.len()), "{} messages", batch.len());
        assert!(
            !pipeline.is_busy(),
            "the finished batch is no longer in flight"
        );
    }

    /// A burst while a batch is in flight: the next batch fills up to its
    /// size and goes without waiting for the one in flight.
    #[tokio::test(start_paused = true)]
    async fn burst_fills_the_batch() {
        let (tx, mut pull) = pull();
        let (mut pipeline, _finish) = busy();
        for n in 1..5000 {
            let _ = tx.unbounded_send(n);
        }
        let batch = gather(0, &mut pull, 1000, &mut pipeline).await;
        assert_eq!(batch.len(), 1000);
        assert!(pipeline.is_busy());
    }
}
