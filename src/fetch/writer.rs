//! The fetch writer: stores fetched lists in groups, one transaction per
//! group, instead of one transaction per user. Thousands of servers answering
//! at once would otherwise queue on commits (measured: 10,000 single-user
//! transactions took 5–7 s; see BENCHMARKS.md).

use std::collections::BTreeSet;

use tokio::sync::{mpsc, oneshot};

use crate::bus::publisher::OutboxHandle;
use crate::decide::fetched::{FetchPlan, FetchRefusal};
use crate::store::Store;
use crate::store::fetched::FetchedUser;

/// Lists stored per transaction at most.
const GROUP: usize = 256;

/// What storing one list came to: stored, refused, or a database error.
pub type WriteOutcome = Result<Result<FetchPlan, FetchRefusal>, String>;

struct Request {
    item: FetchedUser,
    reply: oneshot::Sender<WriteOutcome>,
}

/// Hands fetched lists to the writer task.
#[derive(Clone)]
pub struct FetchWriter {
    queue: mpsc::Sender<Request>,
}

impl FetchWriter {
    /// Starts the writer task; it ends when every handle is dropped.
    pub fn start(store: Store, max_devices: usize, outbox: OutboxHandle) -> FetchWriter {
        let (tx, rx) = mpsc::channel(GROUP * 4);
        tokio::spawn(run(store, max_devices, outbox, rx));
        FetchWriter { queue: tx }
    }

    /// Stores one list (with others that arrive meanwhile) and returns what
    /// became of it once committed.
    pub async fn store(&self, item: FetchedUser) -> WriteOutcome {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Request { item, reply })
            .await
            .map_err(|_| "the fetch writer has stopped".to_owned())?;
        answer
            .await
            .map_err(|_| "the fetch writer has stopped".to_owned())?
    }
}

use crate::store::now_ms;

async fn run(
    store: Store,
    max_devices: usize,
    outbox: OutboxHandle,
    mut queue: mpsc::Receiver<Request>,
) {
    // A request for a user already in the group waits for the next one.
    let mut held: Option<Request> = None;
    loop {
        let first = match held.take() {
            Some(request) => request,
            None => match queue.recv().await {
                Some(request) => request,
                None => return,
            },
        };
        let mut users = BTreeSet::from([first.item.user.clone()]);
        let mut group = vec![first];
        while group.len() < GROUP {
            let Ok(request) = queue.try_recv() else { break };
            if !users.insert(request.item.user.clone()) {
                held = Some(request);
                break;
            }
            group.push(request);
        }
        write_group(&store, max_devices, &outbox, group).await;
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
    let items: Vec<FetchedUser> = group.iter().map(|r| r.item.clone()).collect();
    // Latency is measured from the oldest stale mark of the group.
    let origin = items
        .iter()
        .filter_map(|i| i.stale_at_start.as_ref())
        .map(|m| m.marked_at_ms)
        .min()
        .and_then(|ms| u64::try_from(ms).ok())
        .map(|ms| {
            (
                "fetch",
                std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms),
            )
        });
    match store.apply_fetches(&items, max_devices, now_ms()).await {
        Ok((outcomes, batch)) => {
            if let Some(mut batch) = batch {
                batch.origin = origin;
                outbox.committed(batch).await;
            }
            for (request, outcome) in group.into_iter().zip(outcomes) {
                let _ = request.reply.send(Ok(outcome));
            }
        }
        Err(e) if group.len() == 1 => {
            for request in group {
                let _ = request.reply.send(Err(e.to_string()));
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, lists = group.len(), "storing fetched lists together failed; storing them one by one");
            for request in group {
                let outcome = match store
                    .apply_fetches(std::slice::from_ref(&request.item), max_devices, now_ms())
                    .await
                {
                    Ok((mut outcomes, batch)) => {
                        if let Some(batch) = batch {
                            outbox.committed(batch).await;
                        }
                        outcomes
                            .pop()
                            .ok_or_else(|| "no outcome for a stored list".to_owned())
                    }
                    Err(e) => Err(e.to_string()),
                };
                let _ = request.reply.send(outcome);
            }
        }
    }
}
