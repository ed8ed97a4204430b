//! The fetch-job consumer: takes a server's job from `DEVICE_LIST_FETCH`,
//! fetches that server's stale users one after another, stores each answer,
//! and takes the job out of the stream; or NAKs with a delay when the
//! server fails or when every user left is in its own back-off.
//!
//! One request per server at a time, across replicas: the stream holds at
//! most one job per server and a job is delivered to one consumer at a time
//! (progress acks keep it while a slow server answers). Many servers run in
//! parallel, bounded by `concurrency`. A NAK-delayed job keeps its
//! `max_ack_pending` slot, so the consumer allows far more pending jobs than
//! servers are likely to be backing off at once.
//!
//! Failures are charged by [`super::retry::blame`]: the server's end the job
//! with the server's back-off; a single user's back off that user alone
//! (`stale_user.next_attempt_ms`) and the job goes on with the others. The
//! waits live in the database (`stale_user`, `fetch_server`) so that they
//! survive restarts and are shared by replicas; the job's NAK delay follows
//! them, and a job delivered before its server's wait is over (recreated by
//! the start-up rescan after the queue was lost) goes back to wait the rest.
//!
//! Revalidations (SPEC §5.7) queued for the server run in the same job,
//! after its stale users and one at a time, looking for stale users again
//! before each, so real work never waits behind them. Across servers, at
//! most half of the replica's job slots send revalidations at once; the
//! others stay free for stale users.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{AckKind, Context, Message};
use ruma::{OwnedServerName, OwnedUserId};
use tokio::sync::Semaphore;
use tracing::Instrument as _;

use super::federation::FederationClient;
use super::give_way::{IngestBacklog, Turn};
use super::retry::RetryPolicy;
use super::writer::FetchWriter;
use crate::bus::fetch_jobs::FetchJob;
use crate::faults::Faults;
use crate::shutdown::{AbortOnDrop, Shutdown};
use crate::store::JobStart;
use crate::store::backoff::{DueUser, WorkAhead};
use crate::store::revalidate::DueRevalidation;
use crate::store::{Store, now_ms};

mod end;
mod failures;
pub(crate) mod follow_up;
mod request;
pub(crate) mod starts;
use request::Asked;

/// Stale users read per round of a job.
pub(crate) const USERS_PER_ROUND: u64 = 100;
/// Revalidations sent per round of a job before stale users are looked for
/// again: one, so a stale user waits for at most the request in flight.
const REVALIDATIONS_PER_ROUND: u64 = 1;
/// How long a job with revalidations left waits when every revalidation
/// slot is taken.
const SLOT_WAIT: Duration = Duration::from_secs(1);
/// How long one pull waits.
const PULL_EXPIRY: Duration = Duration::from_secs(1);
/// A job delivered this close to its server's wait end runs anyway (clock
/// differences between replicas).
const EARLY_TOLERANCE_MS: i64 = 50;
/// The wait after our own failure (the database did not answer).
const LOCAL_RETRY: Duration = Duration::from_secs(1);

/// Runs fetch jobs.
#[derive(Clone)]
pub struct Fetcher {
    /// JetStream (to re-enqueue jobs).
    pub js: Context,
    /// The database.
    pub store: Store,
    /// Signed requests to remote servers.
    pub client: Arc<FederationClient>,
    /// Waits after failures.
    pub policy: RetryPolicy,
    /// Servers fetched at once by this replica.
    pub concurrency: usize,
    /// Stores fetched lists (and hands their events to the publisher).
    pub writer: FetchWriter,
    /// The consumer's ack wait: progress acks go out three times per period.
    pub ack_wait: Duration,
    /// Counters and histograms.
    pub metrics: crate::metrics::Metrics,
    /// While ingest has a backlog, jobs wait for one of a few turns.
    pub backlog: IngestBacklog,
    /// Jobs sending revalidations at once (see [`Fetcher::revalidation_slots`]).
    pub revalidation_slots: Arc<Semaphore>,
    /// Jobs' statements run at once (see [`Fetcher::store_turns`]).
    pub store_turns: Arc<Semaphore>,
    /// Reads what starting jobs read, many at once.
    pub starts: starts::JobStarts,
    /// Looks at finished jobs' servers for work queued meanwhile.
    pub follow_ups: follow_up::FollowUps,
    /// Injected faults (test builds only).
    pub faults: Faults,
}

/// What a parked job looks for once more before it parks.
#[derive(Clone, Copy, Debug)]
enum Waiting {
    /// Any due work: it parks because none was left.
    AnyWork,
    /// Stale users only: its revalidations are due but wait for a slot.
    StaleUsers,
}

/// A job in hand: its server, the server's failures in a row when it
/// started, whether the server is still in back-off, and how many of its
/// users failed.
struct Running<'a> {
    server: &'a OwnedServerName,
    failures: u32,
    backing_off: bool,
    /// Users of this job whose own request failed (each backs off alone).
    users_failed: u32,
}

/// How one job ended.
#[derive(Debug, PartialEq, Eq)]
enum JobEnd {
    /// Every stale user of the server was fetched (or none was left).
    Done,
    /// Stale users are left, each in its own back-off: come back when the
    /// first is due (Unix ms).
    Parked(i64),
    /// The server failed (its `failures`-th time in a row): wait this long.
    ServerFailed {
        /// Server failures in a row, this one included.
        failures: u32,
        /// How long to wait.
        wait: Duration,
        /// What happened.
        error: String,
    },
    /// Our side failed; try again shortly, charging nobody.
    Local,
    /// Stopping: give the job back at once.
    Interrupted,
}

impl Fetcher {
    /// The slots of jobs sending revalidations at once: half the job
    /// slots (at least one), so stale users always find free ones.
    pub fn revalidation_slots(concurrency: usize) -> Arc<Semaphore> {
        Arc::new(Semaphore::new((concurrency / 2).max(1)))
    }

    /// The turns of jobs' statements: as many as the PostgreSQL pool has
    /// connections (SQLite's one connection takes them in turn). A thousand
    /// jobs starting together would otherwise each build its statement and
    /// wait for a connection holding it (measured: about 15 MiB at the
    /// fan-out's peak); waiting for a turn holds nothing.
    pub fn store_turns() -> Arc<Semaphore> {
        Arc::new(Semaphore::new(crate::store::POSTGRES_CONNECTIONS))
    }

    /// Runs the job's statement `statement` once a store turn is free. Its
    /// future is made and boxed only then, so a waiting job holds neither
    /// the statement nor room for it in its own state.
    async fn in_turn<T, F>(&self, statement: impl FnOnce() -> F) -> T
    where
        F: std::future::Future<Output = T>,
    {
        let _turn = self.store_turns.acquire().await;
        Box::pin(statement()).await
    }

    /// Pulls and runs jobs until `shutdown` turns true; jobs in hand finish
    /// their current request and are given back.
    pub async fn run(self, consumer: PullConsumer, shutdown: Shutdown) {
        // Shared by the jobs: each holds a pointer, not a copy.
        let fetcher = Arc::new(self);
        let permits = Arc::new(Semaphore::new(fetcher.concurrency.max(1)));
        let mut running = tokio::task::JoinSet::new();
        while !shutdown.is_requested() {
            let free = permits.available_permits();
            if free == 0 {
                // Wait for a job to finish before asking for more.
                tokio::select! {
                    _ = running.join_next() => {}
                    () = shutdown.requested() => {}
                }
                continue;
            }
            // While ingest is behind, one job per turn (see `give_way`).
            let mut turn = tokio::select! {
                turn = fetcher.backlog.turn() => turn,
                () = shutdown.requested() => continue,
            };
            let wanted = if turn.is_some() { 1 } else { free };
            let Some(mut pull) =
                crate::bus::start_pull(&consumer, wanted, PULL_EXPIRY, "fetch jobs").await
            else {
                continue;
            };
            while let Some(message) = crate::bus::next_of_pull(&mut pull, PULL_EXPIRY).await {
                let Ok(message) = message else { break };
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    break;
                };
                let this = fetcher.clone();
                let shutdown = shutdown.clone();
                let turn = turn.take();
                running.spawn(async move {
                    this.handle(message, turn, shutdown).await;
                    drop(permit);
                });
            }
            while running.try_join_next().is_some() {}
        }
        while running.join_next().await.is_some() {}
    }

    /// Runs one job message to its end: ack, NAK with delay, or give back.
    /// `turn`: the job's turn if it was taken while ingest is behind.
    async fn handle(&self, message: Message, turn: Option<Turn>, shutdown: Shutdown) {
        let job: FetchJob = match serde_json::from_slice(&message.payload) {
            Ok(job) => job,
            Err(e) => {
                tracing::warn!(error = %e, subject = %message.subject, "dropping an unreadable fetch job");
                let _ = message.ack_with(AckKind::Term).await;
                return;
            }
        };
        let server = &job.server_name;
        // Progress acks from the start: the database reads below can take a
        // while under load, and an expired ack wait would hand the job to a
        // second replica while this one still runs it.
        let _keep_alive = keep_alive(&message, self.ack_wait / 3);
        let Some((failures, start)) = self.server_ready(&message, server).await else {
            return;
        };
        self.metrics.fetches_in_flight(1);
        let span = tracing::info_span!("fetch_job", server = %server, failures);
        let end = self
            .run_job(server, failures, start, turn, &shutdown)
            .instrument(span)
            .await;
        self.metrics.fetches_in_flight(-1);
        self.end_job(&message, server, end, &shutdown).await;
    }

    /// Whether the server's stored wait is over: its failures in a row so
    /// far and what the job read with the wait (in one statement: its first
    /// round of due stale users, and what else is ahead), or None once the
    /// message has been given back (the wait is not over, or the database
    /// did not answer). The stored wait
    /// is the truth: a job that arrives early (the rescan recreated a lost
    /// queue) waits out the rest.
    async fn server_ready(
        &self,
        message: &Message,
        server: &OwnedServerName,
    ) -> Option<(u32, JobStart)> {
        let start = self.starts.start(server).await;
        let start = match start {
            Ok(start) => start,
            Err(e) => {
                tracing::warn!(error = %e, %server, "cannot read the server's fetch state");
                let _ = message.ack_with(AckKind::Nak(Some(LOCAL_RETRY))).await;
                return None;
            }
        };
        let Some(wait) = start.wait else {
            return Some((0, start));
        };
        let left = wait.next_attempt_ms - now_ms();
        if left > EARLY_TOLERANCE_MS {
            let left = Duration::from_millis(u64::try_from(left).unwrap_or(0));
            tracing::debug!(%server, ?left, "fetch job early; waiting out the server's wait");
            let _ = message.ack_with(AckKind::Nak(Some(left))).await;
            return None;
        }
        if wait.next_attempt_ms != 0
            && let Err(e) = self.in_turn(|| self.store.server_running(server)).await
        {
            tracing::warn!(error = %e, %server, "cannot mark the fetch job running");
            let _ = message.ack_with(AckKind::Nak(Some(LOCAL_RETRY))).await;
            return None;
        }
        Some((u32::try_from(wait.failures).unwrap_or(0), start))
    }

    /// Fetches the server's stale users whose own wait is over, then its
    /// queued revalidations, one request at a time. `failures`: the
    /// server's failures in a row so far; `start`: what was read as the
    /// job started (its first round of due stale users, and what else was
    /// ahead).
    async fn run_job(
        &self,
        server: &OwnedServerName,
        failures: u32,
        start: JobStart,
        mut turn: Option<Turn>,
        shutdown: &Shutdown,
    ) -> JobEnd {
        // A user still stale after its fetch (an update arrived meanwhile)
        // waits for the follow-up job, so one job cannot loop forever.
        let mut done: BTreeSet<OwnedUserId> = BTreeSet::new();
        let mut job = Running {
            server,
            failures,
            backing_off: failures > 0,
            users_failed: 0,
        };
        let mut read = Some(start.due);
        let mut ahead_at_start = start.ahead;
        loop {
            if shutdown.is_requested() {
                return JobEnd::Interrupted;
            }
            let limit = USERS_PER_ROUND + done.len() as u64;
            let due = match read.take() {
                Some(due) => due,
                None => match self.due_users(server, limit).await {
                    Some(users) => users,
                    None => return JobEnd::Local,
                },
            };
            // Fewer than asked for: every due user is in hand (`limit`
            // leaves room for those fetched already and a full round).
            let every_due_read = (due.len() as u64) < limit;
            let todo: Vec<DueUser> = due
                .into_iter()
                .filter(|due| !done.contains(&due.user))
                .collect();
            let fetched_any = !todo.is_empty();
            for due in todo {
                if let Some(end) = self
                    .ask(&mut job, Asked::Stale(&due), &mut turn, shutdown)
                    .await
                {
                    return end;
                }
                done.insert(due.user);
            }
            if !every_due_read {
                ahead_at_start = None;
                continue;
            }
            // Nothing but these users was ahead as the job started, and
            // each answered: the job is done without another look. Work
            // queued meanwhile is found by the look once the job is out of
            // the stream (`end_job`), which enqueues the server's next job.
            if let Some(ahead) = ahead_at_start.take()
                && job.users_failed == 0
                && !ahead.revalidation_due
                && ahead.next_due_ms.is_none()
            {
                return JobEnd::Done;
            }
            // Real work is done: what is ahead, in one statement.
            let Some(ahead) = self.work_ahead(server).await else {
                return JobEnd::Local;
            };
            if fetched_any && ahead.stale_due {
                // Users became due while this round ran: another round.
                continue;
            }
            match self
                .revalidate_round(&mut job, ahead, &mut done, &mut turn, shutdown)
                .await
            {
                Some(end) => return end,
                None => continue,
            }
        }
    }

    /// The server's stale users due now, at most `limit` (None: the
    /// database did not answer).
    async fn due_users(&self, server: &OwnedServerName, limit: u64) -> Option<Vec<DueUser>> {
        self.in_turn(|| self.store.due_stale_users(server, now_ms(), limit))
            .await
            .inspect_err(|e| tracing::warn!(error = %e, "cannot read stale users"))
            .ok()
    }

    /// What the server's job has ahead of it now (None: the database did
    /// not answer).
    async fn work_ahead(&self, server: &OwnedServerName) -> Option<WorkAhead> {
        self.in_turn(|| self.store.work_ahead(server, now_ms()))
            .await
            .inspect_err(|e| tracing::warn!(error = %e, "cannot read the job's work ahead"))
            .ok()
    }

    /// One round of the server's queued revalidations (SPEC §5.7), run once
    /// no stale user is due (`ahead`: what the job has ahead of it): None
    /// to look for stale users again, or how the job ends (nothing left:
    /// done or parked; no slot free; a failure).
    async fn revalidate_round(
        &self,
        job: &mut Running<'_>,
        ahead: WorkAhead,
        done: &mut BTreeSet<OwnedUserId>,
        turn: &mut Option<Turn>,
        shutdown: &Shutdown,
    ) -> Option<JobEnd> {
        if !ahead.revalidation_due {
            // The common end of a job: nothing queued to send, one statement.
            return Some(self.park_or_done(job.server, ahead.next_due_ms).await);
        }
        let due = match self
            .in_turn(|| {
                self.store.due_revalidations(
                    job.server,
                    now_ms(),
                    REVALIDATIONS_PER_ROUND + done.len() as u64,
                )
            })
            .await
        {
            Ok(due) => due,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read queued revalidations");
                return Some(JobEnd::Local);
            }
        };
        let todo: Vec<DueRevalidation> = due
            .into_iter()
            .filter(|due| !done.contains(&due.user))
            .take(REVALIDATIONS_PER_ROUND as usize)
            .collect();
        if todo.is_empty() {
            return Some(self.park_or_done(job.server, ahead.next_due_ms).await);
        }
        let Ok(_slot) = self.revalidation_slots.clone().try_acquire_owned() else {
            // Every revalidation slot is taken: come back shortly, or
            // sooner for a stale user (a parked job is woken for one).
            let until = now_ms() + i64::try_from(SLOT_WAIT.as_millis()).unwrap_or(0);
            return Some(self.park(job.server, until, Waiting::StaleUsers).await);
        };
        for due in todo {
            if let Some(end) = self
                .ask(job, Asked::Revalidation(&due), turn, shutdown)
                .await
            {
                return Some(end);
            }
            done.insert(due.user);
        }
        None
    }

    /// Sends one request of the job and deals with its answer: None to go
    /// on, or how the job ends.
    async fn ask(
        &self,
        job: &mut Running<'_>,
        asked: Asked<'_>,
        turn: &mut Option<Turn>,
        shutdown: &Shutdown,
    ) -> Option<JobEnd> {
        if shutdown.is_requested() {
            return Some(JobEnd::Interrupted);
        }
        // On shutdown a request in flight is abandoned and the job given
        // back at once, rather than holding the stop for up to
        // DLU_FEDERATION_TIMEOUT. A list already handed to the writer is
        // still stored by it.
        let result = tokio::select! {
            result = async {
                self.backlog.keep_turn(turn).await;
                self.fetch_user(asked).await
            } => result,
            () = shutdown.requested() => return Some(JobEnd::Interrupted),
        };
        if let Asked::Revalidation(due) = asked {
            self.revalidated(due, &result).await;
        }
        self.after_fetch(job, asked, result.map(|_| ())).await
    }

    /// No stale user or revalidation is due: the job is done, or parked
    /// until `next_due_ms`, the first user's or revalidation's own wait end.
    async fn park_or_done(&self, server: &OwnedServerName, next_due_ms: Option<i64>) -> JobEnd {
        match next_due_ms {
            Some(due_ms) => self.park(server, due_ms, Waiting::AnyWork).await,
            None => JobEnd::Done,
        }
    }

    /// Parks the job until `due_ms`. The park is written before looking
    /// once more for `waiting`'s work, so work queued meanwhile is either
    /// seen here or finds the job parked and wakes it ([`super::wake`]).
    async fn park(&self, server: &OwnedServerName, due_ms: i64, waiting: Waiting) -> JobEnd {
        if let Err(e) = self
            .in_turn(|| self.store.set_server_wait(server, 0, due_ms, None))
            .await
        {
            tracing::warn!(error = %e, %server, "cannot park the fetch job");
            return JobEnd::Local;
        }
        let due = match waiting {
            Waiting::AnyWork => {
                self.in_turn(|| self.store.has_fetch_work(server, now_ms()))
                    .await
            }
            Waiting::StaleUsers => {
                self.in_turn(|| self.store.has_due_user(server, now_ms()))
                    .await
            }
        };
        match due {
            Ok(false) => JobEnd::Parked(due_ms),
            // Someone became due: run again now rather than park.
            Ok(true) | Err(_) => {
                let _ = self.in_turn(|| self.store.server_running(server)).await;
                JobEnd::Local
            }
        }
    }
}

/// Sends progress acks, one at once and then every `every`, so a job
/// survives slow servers, until the returned guard is dropped (on every way
/// out of the job).
fn keep_alive(message: &Message, every: Duration) -> AbortOnDrop {
    let message = message.clone();
    AbortOnDrop::spawn(async move {
        // The first at once: the ack wait began when the server delivered
        // the job, which may have waited in the pull's buffer meanwhile.
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if message.ack_with(AckKind::Progress).await.is_err() {
                return;
            }
        }
    })
}
