//! The one way into the fetch queue for users that need fetching (SPEC
//! §5.2). Every path that marks a user stale or starts tracking one (an
//! update, a resync from the input, the RPC or `admin`, a join, a link
//! turning verified, our server joining a room, a room sweep, the start-up
//! rescan) hands the users' servers to [`FetchQueue::stale`], which does the
//! two things each of them needs:
//!
//! 1. enqueue the server's job (a server that has one already keeps it:
//!    one job per server);
//! 2. have a job that is already there but parked, waiting only on *other*
//!    users' own back-offs, started now ([`super::wake`]), so one user's
//!    back-off never delays another user of the same server.
//!
//! A server in its own back-off keeps its wait: its failure was its own.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::Context;
use ruma::OwnedServerName;

use super::wake::{WakeError, Wakeups, wake_round};
use crate::bus::fetch_jobs;
use crate::faults::Faults;
use crate::store::Store;

/// Tries of enqueueing a woken job in a process without a wake-up task.
const INLINE_TRIES: u32 = 20;
/// The wait between those tries.
const INLINE_WAIT: Duration = Duration::from_millis(500);

/// Where parked jobs are checked.
#[derive(Clone)]
enum Waker {
    /// By the worker's wake-up task, in coalesced rounds.
    Task(Wakeups),
    /// At once, in the caller (a process without that task: `admin`).
    Inline { store: Store, min_gap: Duration },
}

/// Enqueues fetch jobs and starts parked ones; cheap to clone.
#[derive(Clone)]
pub struct FetchQueue {
    js: Context,
    waker: Waker,
}

impl FetchQueue {
    /// The queue of a worker, whose wake-up task checks parked jobs.
    pub fn new(js: Context, wakeups: Wakeups) -> FetchQueue {
        FetchQueue {
            js,
            waker: Waker::Task(wakeups),
        }
    }

    /// The queue of a process without a wake-up task: parked jobs are
    /// checked in [`FetchQueue::stale`] itself. `min_gap`: `DLU_RETRY_MIN`.
    pub fn inline(js: Context, store: Store, min_gap: Duration) -> FetchQueue {
        FetchQueue {
            js,
            waker: Waker::Inline { store, min_gap },
        }
    }

    /// `servers` have users just marked stale or starting to be tracked:
    /// each gets its job, and a parked one runs now. Call after the stale
    /// marks are committed.
    pub async fn stale<'a>(
        &self,
        servers: impl IntoIterator<Item = &'a OwnedServerName> + Clone,
    ) -> Result<(), WakeError> {
        fetch_jobs::enqueue(&self.js, servers.clone()).await?;
        match &self.waker {
            Waker::Task(wakeups) => {
                wakeups.note_all(servers.into_iter().map(|s| (&**s, false)));
            }
            Waker::Inline { store, min_gap } => {
                let noted: BTreeMap<OwnedServerName, Option<i64>> =
                    servers.into_iter().map(|s| (s.clone(), None)).collect();
                let woken = wake_round(store, &self.js, &noted, *min_gap, Faults::default()).await;
                if let Err(WakeError::Unqueued { server, source }) = woken {
                    // No wake-up task here to enqueue it later: now.
                    if !self.enqueue_woken(&server).await {
                        return Err(WakeError::Unqueued { server, source });
                    }
                } else {
                    woken?;
                }
            }
        }
        Ok(())
    }

    /// Enqueues the job of `server`, woken but not enqueued, trying a few
    /// times over some seconds (a leader election); false if it never
    /// succeeded (its users wait for a worker's start-up rescan).
    async fn enqueue_woken(&self, server: &OwnedServerName) -> bool {
        for _ in 0..INLINE_TRIES {
            match fetch_jobs::enqueue(&self.js, [server]).await {
                Ok(()) => return true,
                Err(e) => {
                    tracing::warn!(error = %e, %server, "woken fetch job not enqueued; retrying")
                }
            }
            tokio::time::sleep(INLINE_WAIT).await;
        }
        false
    }

    /// The wake-up task's notes, for input that came from a server itself
    /// (an update ends the server's back-off, §5.2), or `None` inline.
    pub fn wakeups(&self) -> Option<&Wakeups> {
        match &self.waker {
            Waker::Task(wakeups) => Some(wakeups),
            Waker::Inline { .. } => None,
        }
    }
}
