//! The fetch writer: stores fetched lists in groups, one transaction per
//! group, instead of one transaction per user. Thousands of servers answering
//! at once would otherwise queue on commits (measured: 10,000 single-user
//! transactions took 5–7 s; see BENCHMARKS.md).

use std::future::Future;

use sea_orm::DbErr;
use tokio::sync::{mpsc, oneshot};

use super::gather::{Gathering, gather, without_repeats};
use crate::bus::publisher::OutboxHandle;
use crate::decide::fetched::{FetchPlan, FetchRefusal};
use crate::store::fetched::FetchedUser;
use crate::store::{Store, now_ms};

/// Lists stored per transaction at most.
const GROUP: usize = 256;
/// How lists are gathered into a transaction. Servers answer one by one,
/// and a writer that took only what was queued stored groups of 20 to 85
/// lists, as the database's pace happened to make them (measured over
/// 10,000 users: 118 to 441 transactions of about a dozen statements
/// each). Lists that keep coming, each within 2 ms of the one before, are
/// gathered for up to 20 ms; a job fetching its server's users alone,
/// whose next request waits for this list's answer, waits 2 ms.
const GATHER: Gathering = Gathering {
    gap: std::time::Duration::from_millis(2),
    window: std::time::Duration::from_millis(20),
    most: GROUP,
};

/// What storing one fetched list came to.
#[derive(Debug)]
pub enum Written {
    /// Stored as planned (the plan says what was left out).
    Stored(FetchPlan),
    /// Refused by the rules: the answer is not this user's list.
    Refused(FetchRefusal),
    /// Not stored: our side failed.
    Failed(WriteError),
}

/// Why a list could not be stored.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The database refused or did not answer.
    #[error("cannot store the list: {0}")]
    Database(#[from] DbErr),
    /// The writer task is gone (shutting down).
    #[error("the fetch writer has stopped")]
    Stopped,
}

impl From<Result<FetchPlan, FetchRefusal>> for Written {
    fn from(planned: Result<FetchPlan, FetchRefusal>) -> Self {
        match planned {
            Ok(plan) => Written::Stored(plan),
            Err(refusal) => Written::Refused(refusal),
        }
    }
}

struct Request {
    item: FetchedUser,
    reply: oneshot::Sender<Written>,
}

/// Hands fetched lists to the writer task.
#[derive(Clone)]
pub struct FetchWriter {
    queue: mpsc::Sender<Request>,
}

impl FetchWriter {
    /// The writer and its task, for the caller to run (the worker keeps it
    /// with its other tasks). The task ends once every handle is dropped and
    /// what they handed over is stored.
    pub fn new(
        store: Store,
        max_devices: usize,
        outbox: OutboxHandle,
    ) -> (FetchWriter, impl Future<Output = ()> + Send + 'static) {
        let (tx, rx) = mpsc::channel(GROUP * 4);
        (
            FetchWriter { queue: tx },
            run(store, max_devices, outbox, rx),
        )
    }

    /// Stores one list (with others that arrive meanwhile) and returns what
    /// became of it once committed.
    pub async fn store(&self, item: FetchedUser) -> Written {
        let (reply, answer) = oneshot::channel();
        if self.queue.send(Request { item, reply }).await.is_err() {
            return Written::Failed(WriteError::Stopped);
        }
        answer.await.unwrap_or(Written::Failed(WriteError::Stopped))
    }
}

async fn run(
    store: Store,
    max_devices: usize,
    outbox: OutboxHandle,
    mut queue: mpsc::Receiver<Request>,
) {
    while let Some(requests) = gather(&mut queue, GATHER).await {
        // A list of a user already in the group waits for the next one.
        for group in without_repeats(requests, |request| request.item.user.clone()) {
            write_group(&store, max_devices, &outbox, group).await;
        }
    }
}

/// Stores a group in one transaction; if that fails, each list alone, so
/// one list the database refuses does not fail the others.
async fn write_group(
    store: &Store,
    max_devices: usize,
    outbox: &OutboxHandle,
    group: Vec<Request>,
) {
    let (items, replies): (Vec<FetchedUser>, Vec<oneshot::Sender<Written>>) = group
        .into_iter()
        .map(|request| (request.item, request.reply))
        .unzip();
    // Latency is measured from each user's stale mark.
    let origin = crate::store::outbox::Origin {
        source: "fetch",
        since: items
            .iter()
            .filter_map(|i| i.stale_at_start.as_ref())
            .filter_map(|m| u64::try_from(m.marked_at_ms).ok())
            .map(|ms| std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
            .collect(),
    };
    match store.apply_fetches(&items, max_devices, now_ms()).await {
        Ok((outcomes, batch)) => {
            if let Some(mut batch) = batch {
                batch.origin = Some(origin);
                outbox.committed(batch).await;
            }
            for (reply, outcome) in replies.into_iter().zip(outcomes) {
                let _ = reply.send(outcome.into());
            }
        }
        Err(e) if items.len() == 1 => {
            if let Some(reply) = replies.into_iter().next() {
                let _ = reply.send(Written::Failed(e.into()));
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, lists = items.len(), "storing fetched lists together failed; storing them one by one");
            for (item, reply) in items.iter().zip(replies) {
                let outcome = match store
                    .apply_fetches(std::slice::from_ref(item), max_devices, now_ms())
                    .await
                {
                    Ok((mut outcomes, batch)) => {
                        if let Some(batch) = batch {
                            outbox.committed(batch).await;
                        }
                        match outcomes.pop() {
                            Some(outcome) => outcome.into(),
                            None => Written::Failed(WriteError::Database(DbErr::Custom(
                                "no outcome for a stored list".into(),
                            ))),
                        }
                    }
                    Err(e) => Written::Failed(e.into()),
                };
                let _ = reply.send(outcome);
            }
        }
    }
}
