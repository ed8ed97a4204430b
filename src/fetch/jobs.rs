//! The fetch-job consumer: takes a server's job from `DEVICE_LIST_FETCH`,
//! fetches that server's stale users one after another, stores each answer,
//! and acks, or NAKs with the back-off delay when the server fails.
//!
//! One request per server at a time, across replicas: the stream holds at
//! most one job per server and a job is delivered to one consumer at a time
//! (progress acks keep it while a slow server answers). Many servers run in
//! parallel, bounded by `concurrency`. A NAK-delayed job keeps its
//! `max_ack_pending` slot, so the consumer allows far more pending jobs than
//! servers are likely to be backing off at once.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{AckKind, Context, Message};
use ruma::{OwnedServerName, OwnedUserId};
use tokio::sync::{Semaphore, watch};
use tracing::Instrument as _;

use super::federation::{FederationClient, FetchFailure};
use super::retry::{Failure, RetryPolicy, spread};
use super::writer::FetchWriter;
use crate::bus::fetch_jobs::{self, FetchJob};
use crate::bus::streams::FETCH_STREAM;
use crate::store::Store;
use crate::store::fetched::FetchedUser;

/// Durable name of the fetch-job consumer, shared by all replicas.
pub const FETCH_CONSUMER: &str = "device-list-updater-fetch";
/// Stale users read per round of a job.
const USERS_PER_ROUND: u64 = 100;
/// Jobs that may be pending (delivered, or NAK-delayed) at once.
const MAX_PENDING_JOBS: i64 = 1_000_000;
/// How long one pull waits.
const PULL_EXPIRY: Duration = Duration::from_secs(1);

/// Creates (or opens) the shared fetch-job consumer. A job whose replica
/// stops sending progress acks (it died) is redelivered after `ack_wait`.
pub async fn consumer(js: &Context, ack_wait: Duration) -> Result<PullConsumer, String> {
    let stream = js
        .get_stream(FETCH_STREAM)
        .await
        .map_err(|e| format!("cannot open stream {FETCH_STREAM}: {e}"))?;
    let config = pull::Config {
        durable_name: Some(FETCH_CONSUMER.into()),
        description: Some("device-list-updater: per-server fetch jobs".into()),
        ack_policy: AckPolicy::Explicit,
        ack_wait,
        // Jobs are retried for as long as the server fails, with back-off.
        max_deliver: -1,
        max_ack_pending: MAX_PENDING_JOBS,
        ..Default::default()
    };
    stream
        .get_or_create_consumer(FETCH_CONSUMER, config)
        .await
        .map_err(|e| format!("cannot create consumer {FETCH_CONSUMER}: {e}"))
}

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
    /// `DLU_MAX_DEVICES`.
    pub max_devices: usize,
    /// Servers fetched at once by this replica.
    pub concurrency: usize,
    /// Stores fetched lists (and hands their events to the publisher).
    pub writer: FetchWriter,
    /// The consumer's ack wait: progress acks go out three times per period.
    pub ack_wait: Duration,
    /// Counters and histograms.
    pub metrics: crate::metrics::Metrics,
}

/// How one job ended.
#[derive(Debug, PartialEq, Eq)]
enum JobEnd {
    /// Every stale user of the server was fetched (or none was left).
    Done,
    /// The server failed; wait this long.
    Failed(Duration),
    /// Stopping: give the job back at once.
    Interrupted,
}

impl Fetcher {
    /// Pulls and runs jobs until `shutdown` turns true; jobs in hand finish
    /// their current request and are given back.
    pub async fn run(self, consumer: PullConsumer, shutdown: watch::Receiver<bool>) {
        let permits = Arc::new(Semaphore::new(self.concurrency.max(1)));
        let mut running = tokio::task::JoinSet::new();
        while !*shutdown.borrow() {
            let free = permits.available_permits();
            if free == 0 {
                // Wait for a job to finish before asking for more.
                let mut shutdown = shutdown.clone();
                tokio::select! {
                    _ = running.join_next() => {}
                    _ = shutdown.changed() => {}
                }
                continue;
            }
            let pull = consumer
                .batch()
                .max_messages(free)
                .expires(PULL_EXPIRY)
                .messages()
                .await;
            let mut pull = match pull {
                Ok(pull) => pull,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot pull fetch jobs; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            while let Some(message) = crate::bus::next_of_pull(&mut pull, PULL_EXPIRY).await {
                let Ok(message) = message else { break };
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    break;
                };
                let this = self.clone();
                let shutdown = shutdown.clone();
                running.spawn(async move {
                    this.handle(message, shutdown).await;
                    drop(permit);
                });
            }
            while running.try_join_next().is_some() {}
        }
        while running.join_next().await.is_some() {}
    }

    /// Runs one job message to its end: ack, NAK with delay, or give back.
    async fn handle(&self, message: Message, shutdown: watch::Receiver<bool>) {
        let job: FetchJob = match serde_json::from_slice(&message.payload) {
            Ok(job) => job,
            Err(e) => {
                tracing::warn!(error = %e, subject = %message.subject, "dropping an unreadable fetch job");
                let _ = message.ack_with(AckKind::Term).await;
                return;
            }
        };
        let failures = message
            .info()
            .map(|i| u32::try_from(i.delivered).unwrap_or(u32::MAX))
            .unwrap_or(1);
        let end = {
            let keep_alive = keep_alive(&message, self.ack_wait / 3);
            self.metrics.fetches_in_flight(1);
            let span = tracing::info_span!("fetch_job", server = %job.server_name, failures);
            let end = self
                .run_job(&job.server_name, failures, &shutdown)
                .instrument(span)
                .await;
            self.metrics.fetches_in_flight(-1);
            keep_alive.abort();
            end
        };
        match end {
            JobEnd::Done => {
                if let Err(e) = message.double_ack().await {
                    tracing::warn!(error = %e, server = %job.server_name, "fetch job ack failed; it will run again");
                    return;
                }
                // Users marked stale while this job was in hand could not
                // enqueue a second job for the server: look again.
                match self.store.stale_users(&job.server_name, 1).await {
                    Ok(users) if !users.is_empty() => self.enqueue(&job.server_name).await,
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot check for stale users; enqueueing anyway");
                        self.enqueue(&job.server_name).await;
                    }
                }
            }
            JobEnd::Failed(delay) => {
                tracing::info!(server = %job.server_name, failures, delay = ?delay, "fetch failed; backing off");
                let _ = message.ack_with(AckKind::Nak(Some(delay))).await;
            }
            JobEnd::Interrupted => {
                // Stopping: give the job back, delayed past this replica's
                // open pull so it is not handed straight back to us.
                let _ = message.ack_with(AckKind::Nak(Some(PULL_EXPIRY * 2))).await;
            }
        }
    }

    async fn enqueue(&self, server: &OwnedServerName) {
        if let Err(e) = fetch_jobs::enqueue(&self.js, [server]).await {
            tracing::warn!(error = %e, %server, "cannot re-enqueue a fetch job; the start-up rescan will");
        }
    }

    /// Fetches the server's stale users, one request at a time.
    async fn run_job(
        &self,
        server: &OwnedServerName,
        failures: u32,
        shutdown: &watch::Receiver<bool>,
    ) -> JobEnd {
        // A user still stale after its fetch (an update arrived meanwhile)
        // waits for the follow-up job, so one job cannot loop forever.
        let mut fetched: BTreeSet<OwnedUserId> = BTreeSet::new();
        loop {
            if *shutdown.borrow() {
                return JobEnd::Interrupted;
            }
            let users = match self
                .store
                .stale_users(server, USERS_PER_ROUND + fetched.len() as u64)
                .await
            {
                Ok(users) => users,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read stale users");
                    return JobEnd::Failed(Duration::from_secs(1));
                }
            };
            let todo: Vec<_> = users
                .into_iter()
                .filter(|(user, _)| !fetched.contains(user))
                .collect();
            if todo.is_empty() {
                return JobEnd::Done;
            }
            for (user, mark) in todo {
                if *shutdown.borrow() {
                    return JobEnd::Interrupted;
                }
                // On shutdown a request in flight is abandoned and the job
                // given back at once, rather than holding the stop for up to
                // DLU_FEDERATION_TIMEOUT. A list already handed to the writer
                // is still stored by it.
                let mut stop = shutdown.clone();
                let fetched_one = tokio::select! {
                    result = self.fetch_user(&user, &mark) => result,
                    _ = stop.wait_for(|s| *s) => return JobEnd::Interrupted,
                };
                if let Err(failure) = fetched_one {
                    tracing::info!(%user, reason = %failure.reason, "fetch failed");
                    if let Err(e) = self.store.note_fetch_error(&user, &failure.reason).await {
                        tracing::debug!(error = %e, "cannot record the fetch error");
                    }
                    let delay = self.policy.delay(failures, failure.failure);
                    let unit = f64::from(getrandom::u32().unwrap_or(0)) / f64::from(u32::MAX);
                    return JobEnd::Failed(spread(delay, 0.1, unit));
                }
                fetched.insert(user);
            }
        }
    }

    /// Fetches and stores one user.
    pub async fn fetch_user(
        &self,
        user: &OwnedUserId,
        mark: &crate::decide::StaleMark,
    ) -> Result<(), FetchFailure> {
        let server = user.server_name().as_str();
        let started = std::time::Instant::now();
        let answer = self.client.get_devices(user).await;
        let seconds = started.elapsed().as_secs_f64();
        let (list, unreadable) = match answer {
            Ok(answer) => answer,
            Err(failure) => {
                self.metrics.fetch(server, failure_label(&failure), seconds);
                return Err(failure);
            }
        };
        if unreadable > 0 {
            tracing::warn!(%user, unreadable, "left out unreadable device entries");
        }
        let plan = self
            .writer
            .store(FetchedUser {
                user: user.clone(),
                stale_at_start: Some(mark.clone()),
                list,
            })
            .await
            .map_err(|e| FetchFailure {
                failure: Failure::Transient,
                reason: format!("cannot store the list: {e}"),
            })?
            .map_err(|refusal| {
                self.metrics.fetch(server, "user_mismatch", seconds);
                FetchFailure {
                    failure: Failure::Transient,
                    reason: format!("answer refused: {refusal:?}"),
                }
            })?;
        self.metrics.fetch(
            server,
            if plan.too_many_devices.is_some() {
                "too_many_devices"
            } else {
                "stored"
            },
            seconds,
        );
        if !plan.skipped_devices.is_empty() {
            tracing::warn!(%user, devices = ?plan.skipped_devices, "skipped devices whose keys name another user or device");
        }
        if !plan.skipped_keys.is_empty() {
            tracing::warn!(%user, keys = ?plan.skipped_keys, "ignored malformed cross-signing keys");
        }
        if let Some(count) = plan.too_many_devices {
            tracing::warn!(%user, count, max = self.max_devices, "device list over DLU_MAX_DEVICES not stored");
        }
        Ok(())
    }
}

/// The metric label of a failed fetch.
fn failure_label(failure: &FetchFailure) -> &'static str {
    match failure.failure {
        Failure::Transient => "failed",
        Failure::SlowDown(_) => "rate_limited",
        Failure::Refused => "refused_by_server",
    }
}

/// Sends progress acks every `every` so a job survives slow servers; abort
/// it when done.
fn keep_alive(message: &Message, every: Duration) -> tokio::task::AbortHandle {
    let message = message.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            if message.ack_with(AckKind::Progress).await.is_err() {
                return;
            }
        }
    })
    .abort_handle()
}
