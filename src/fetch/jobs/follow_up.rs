//! The look that follows a finished job (SPEC §5.2). The stream holds one
//! job per server, so a user marked stale while the server's job was in
//! hand could not enqueue a second one: once the job is out of the stream,
//! its server is looked at again, and its next job enqueued if any stale
//! user or revalidation is queued, due or still in its own wait.
//!
//! Jobs end by the hundred when many servers answer at once, and the look
//! was a statement of each job's own (with its round trip, and the pool's
//! check of the connection after it). Here one task looks at every server
//! whose job ended meanwhile in one statement
//! ([`Store::servers_with_fetch_work`]) and enqueues their next jobs
//! together. A job hands its server over and is done; the handing over
//! waits only when the task is behind by a full queue.

use std::collections::BTreeSet;
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::Context;
use ruma::OwnedServerName;
use tokio::sync::mpsc;

use crate::bus::fetch_jobs;
use crate::fetch::gather::{Gathering, gather};
use crate::shutdown::Shutdown;
use crate::store::Store;

/// How finished jobs' servers are gathered. Jobs end one by one as their
/// servers answer, a few milliseconds apart even in a burst: looking at
/// once would look at one or two servers per statement (measured: about
/// 1,100 statements for 2,000 jobs). Servers that keep coming, each within
/// 5 ms of the one before, are gathered for up to 50 ms, at most 512.
/// Only a server whose work was queued while its job ran waits for this.
const GATHER: Gathering = Gathering {
    gap: Duration::from_millis(5),
    window: Duration::from_millis(50),
    most: 512,
};

/// Hands finished jobs' servers to the follow-up task.
#[derive(Clone)]
pub struct FollowUps {
    queue: mpsc::Sender<OwnedServerName>,
}

impl FollowUps {
    /// The handle and its task, for the caller to run. The task ends once
    /// every handle is dropped and each server handed over was looked at;
    /// a look or enqueue that still fails once `shutdown` is requested is
    /// left to the start-up rescan, which finds every stale user.
    pub fn new(
        store: Store,
        js: Context,
        shutdown: Shutdown,
    ) -> (FollowUps, impl Future<Output = ()> + Send + 'static) {
        let (tx, rx) = mpsc::channel(GATHER.most * 2);
        (FollowUps { queue: tx }, run(store, js, shutdown, rx))
    }

    /// Looks at `server` (whose job is out of the stream) soon, with the
    /// others that finish meanwhile.
    pub async fn after(&self, server: &OwnedServerName) {
        if self.queue.send(server.clone()).await.is_err() {
            tracing::debug!(%server, "the follow-up task has stopped; the start-up rescan finds the server's work");
        }
    }
}

async fn run(
    store: Store,
    js: Context,
    shutdown: Shutdown,
    mut queue: mpsc::Receiver<OwnedServerName>,
) {
    while let Some(servers) = gather(&mut queue, GATHER).await {
        let servers: BTreeSet<OwnedServerName> = servers.into_iter().collect();
        follow_up(&store, &js, &shutdown, &servers).await;
    }
}

/// Enqueues the next job of those of `servers` with work queued: any stale
/// user or revalidation counts, due or still in its own back-off. When the
/// database does not answer, every one of them is enqueued (a job with
/// nothing to do ends at once). Nothing else would enqueue them (their
/// work's own enqueue was refused while their jobs were pending), so a
/// failed enqueue (the stream's leader moving) is retried until it
/// succeeds or the stop is requested.
async fn follow_up(
    store: &Store,
    js: &Context,
    shutdown: &Shutdown,
    servers: &BTreeSet<OwnedServerName>,
) {
    let with_work = match store.servers_with_fetch_work(servers, i64::MAX).await {
        Ok(found) => found,
        Err(e) => {
            tracing::warn!(error = %e, servers = servers.len(), "cannot check finished jobs' servers for stale users; enqueueing them all");
            servers.clone()
        }
    };
    if with_work.is_empty() {
        return;
    }
    shutdown
        .retry("enqueue servers' next fetch jobs", || {
            fetch_jobs::enqueue(js, &with_work)
        })
        .await;
}
