//! Wake-ups (SPEC §5.2): input about a server's users can end the wait of
//! that server's fetch job.
//!
//! - An update or signing-key update from a server in back-off shows that it
//!   is up: the back-off ends and its stale users are fetched now, at most
//!   once per `DLU_RETRY_MIN` per server (a flapping server cannot turn a
//!   storm of updates into a storm of requests).
//! - A server whose job is parked only because its known stale users are in
//!   their own back-off gets a new stale user: the job runs now for it.
//!
//! Either way the server's row in `fetch_server` is changed by
//! compare-and-set, so exactly one replica wins, and the waiting job message
//! (in a NAK delay on whichever replica's consumer) is replaced by one that
//! is deliverable at once ([`crate::bus::fetch_jobs::replace`]). A job that
//! is running is never waiting, so it is never replaced: one request per
//! server at a time still holds. A server whose wait was ended but whose
//! new job was not stored (the old message may be gone) is enqueued again
//! before each later round until it is: no round would see it waiting.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::Context;
use ruma::{OwnedServerName, ServerName};
use tokio::sync::Notify;

use crate::faults::Faults;
use crate::shutdown::Shutdown;

use crate::bus::fetch_jobs;
use crate::metrics::Metrics;
use crate::store::backoff::ServerWait;
use crate::store::{Store, now_ms};

/// Why a waiting job is started early.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// The server sent an update while in back-off.
    BackOffEnded,
    /// The job was parked for its users' own waits and a user is due now.
    UserDue,
}

impl Wake {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Wake::BackOffEnded => "back_off_ended",
            Wake::UserDue => "user_due",
        }
    }
}

/// Whether the job of a server in state `wait` is started now (pure).
///
/// `heard_at_ms`: when an update or signing-key update from the server
/// itself was last committed (None: nothing heard from it). Only what was
/// heard after its last failure shows it is up: the update that made a user
/// stale does not end the back-off its own fetch began.
/// `due_user`: the server has a stale user whose own wait is over (only
/// asked when the job is parked rather than backing off).
pub fn wake_reason(
    wait: &ServerWait,
    now_ms: i64,
    min_gap: Duration,
    heard_at_ms: Option<i64>,
    due_user: bool,
) -> Option<Wake> {
    if wait.next_attempt_ms <= now_ms {
        // Not waiting: running, or due anyway.
        return None;
    }
    if wait.failures > 0 {
        let gap = i64::try_from(min_gap.as_millis()).unwrap_or(i64::MAX);
        let rested = now_ms.saturating_sub(wait.last_wake_ms) >= gap;
        let heard = heard_at_ms.is_some_and(|at| at > wait.failed_at_ms);
        return (heard && rested).then_some(Wake::BackOffEnded);
    }
    due_user.then_some(Wake::UserDue)
}

/// Collects servers that input was about and checks their jobs in the
/// background, coalescing bursts: a server noted many times while a round
/// runs is checked once in the next.
#[derive(Clone, Default)]
pub struct Wakeups {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Server → when the server itself was last heard from (Unix ms).
    pending: Mutex<BTreeMap<OwnedServerName, Option<i64>>>,
    notify: Notify,
}

/// Pause between rounds, so a steady stream of batches costs a few cheap
/// queries a second, not one per batch.
const ROUND_PAUSE: Duration = Duration::from_millis(100);

impl Wakeups {
    /// Notes servers to check, each with `heard`: input came from the server
    /// itself (an update or a signing-key update: its back-off may end), or
    /// it has users just marked stale (a parked job may start). One lock, one
    /// wake of the checker, and no allocation for a server noted already
    /// (ingest calls this for every batch).
    pub fn note_all<'a>(&self, notes: impl IntoIterator<Item = (&'a ServerName, bool)>) {
        let now = now_ms();
        let mut pending = self
            .inner
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (server, heard) in notes {
            let heard_at = heard.then_some(now);
            match pending.get_mut(server) {
                Some(entry) => *entry = (*entry).max(heard_at),
                None => {
                    pending.insert(server.to_owned(), heard_at);
                }
            }
        }
        drop(pending);
        self.inner.notify.notify_one();
    }

    fn take(&self) -> BTreeMap<OwnedServerName, Option<i64>> {
        std::mem::take(
            &mut *self
                .inner
                .pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Checks noted servers until `shutdown` turns true.
    pub async fn run(self, checker: WakeChecker, shutdown: Shutdown) {
        // Servers woken whose job is not stored yet (see
        // [`WakeError::Unqueued`]): enqueued before each round until it is.
        let mut unqueued: BTreeSet<OwnedServerName> = BTreeSet::new();
        loop {
            if unqueued.is_empty() {
                tokio::select! {
                    () = self.inner.notify.notified() => {}
                    () = shutdown.requested() => return,
                }
            }
            if !unqueued.is_empty() {
                match fetch_jobs::enqueue(&checker.js, &unqueued).await {
                    Ok(()) => unqueued.clear(),
                    Err(e) => tracing::warn!(error = %e, "woken fetch jobs not enqueued; retrying"),
                }
            }
            let noted = self.take();
            if !noted.is_empty() {
                self.round(&checker, noted, &mut unqueued).await;
            }
            tokio::select! {
                () = tokio::time::sleep(ROUND_PAUSE) => {}
                () = shutdown.requested() => return,
            }
        }
    }

    /// One round over `noted`: wakes what may be woken; on a failure, puts
    /// the servers back for the next round, and a server woken but not
    /// enqueued into `unqueued`.
    async fn round(
        &self,
        checker: &WakeChecker,
        noted: BTreeMap<OwnedServerName, Option<i64>>,
        unqueued: &mut BTreeSet<OwnedServerName>,
    ) {
        let result = wake_round(
            &checker.store,
            &checker.js,
            &noted,
            checker.min_gap,
            checker.faults,
        )
        .await;
        match result {
            Ok(woken) => {
                for (server, wake) in woken {
                    tracing::info!(%server, reason = wake.as_str(), "fetch job woken");
                    checker.metrics.wakeup(wake.as_str());
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "wake-up check failed; retrying");
                if let WakeError::Unqueued { server, .. } = &e {
                    unqueued.insert(server.clone());
                }
                let mut pending = self
                    .inner
                    .pending
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                for (server, heard_at) in noted {
                    let entry = pending.entry(server).or_default();
                    *entry = (*entry).max(heard_at);
                }
            }
        }
    }
}

/// What the wake-up task checks with.
pub struct WakeChecker {
    /// The database.
    pub store: Store,
    /// JetStream, to replace jobs.
    pub js: Context,
    /// `DLU_RETRY_MIN`: at most one back-off ended per server this often.
    pub min_gap: Duration,
    /// Wake-up counters.
    pub metrics: Metrics,
    /// Injected faults (test builds only).
    pub faults: Faults,
}

/// Why a wake-up round failed (it is retried with the next round).
#[derive(Debug, thiserror::Error)]
pub enum WakeError {
    /// The database.
    #[error(transparent)]
    Database(#[from] sea_orm::DbErr),
    /// Replacing the job.
    #[error(transparent)]
    Bus(#[from] crate::bus::BusError),
    /// The server's wait was ended but its job not replaced: the old
    /// message may be gone, and no later round sees the server waiting, so
    /// the caller enqueues its job until it is stored.
    #[error("the fetch job of {server} was woken but not enqueued: {source}")]
    Unqueued {
        /// The server whose job is to be enqueued.
        server: OwnedServerName,
        /// Why the replacing job was not stored.
        #[source]
        source: crate::bus::BusError,
    },
}

/// One check of `noted` servers (→ when heard from itself): ends the waits that
/// [`wake_reason`] allows and replaces their jobs. Returns the woken ones.
pub async fn wake_round(
    store: &Store,
    js: &Context,
    noted: &BTreeMap<OwnedServerName, Option<i64>>,
    min_gap: Duration,
    faults: Faults,
) -> Result<Vec<(OwnedServerName, Wake)>, WakeError> {
    let now = now_ms();
    let servers: Vec<&ServerName> = noted.keys().map(|s| &**s).collect();
    let waiting = store.waiting_servers(&servers, now).await?;
    let mut woken = Vec::new();
    for wait in waiting {
        let Ok(server) = OwnedServerName::try_from(wait.server_name.as_str()) else {
            continue;
        };
        let heard = noted.get(&server).copied().flatten();
        let due_user = wait.failures == 0 && store.has_fetch_work(&server, now).await?;
        let Some(wake) = wake_reason(&wait, now, min_gap, heard, due_user) else {
            continue;
        };
        let woken_at = (wake == Wake::BackOffEnded).then_some(now);
        if !store.end_server_wait(&wait, woken_at).await? {
            // Another replica woke it, or its job changed it: nothing to do.
            continue;
        }
        if let Err(source) = fetch_jobs::replace(js, &server, faults).await {
            return Err(WakeError::Unqueued { server, source });
        }
        woken.push((server, wake));
    }
    Ok(woken)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN_GAP: Duration = Duration::from_secs(60);
    const NOW: i64 = 1_000_000;

    /// When the server failed in the table below.
    const FAILED: i64 = NOW - 1_000;

    fn wait(failures: i32, next_attempt_ms: i64, last_wake_ms: i64) -> ServerWait {
        ServerWait {
            server_name: "remote.example".into(),
            failures,
            next_attempt_ms,
            failed_at_ms: if failures > 0 { FAILED } else { 0 },
            last_wake_ms,
            last_error: None,
        }
    }

    #[test]
    fn wake_table() {
        use Wake::{BackOffEnded, UserDue};
        let later = NOW + 40_000;
        let (yes, no, before) = (Some(NOW - 10), None, Some(FAILED - 1));
        let table = [
            // (failures, next attempt, last wake, heard, due user, expected)
            // In back-off: an update from the server ends it.
            (3, later, 0, yes, false, Some(BackOffEnded)),
            (3, later, 0, yes, true, Some(BackOffEnded)),
            // Heard before the failure: not a sign that it is up.
            (3, later, 0, before, true, None),
            // A resync (not from the server) does not.
            (3, later, 0, no, true, None),
            // At most one wake per DLU_RETRY_MIN.
            (3, later, NOW - 59_999, yes, false, None),
            (3, later, NOW - 60_000, yes, false, Some(BackOffEnded)),
            // Not waiting (running, or the wait is over): nothing to do.
            (3, NOW, 0, yes, true, None),
            (0, 0, 0, yes, true, None),
            // Parked for users' own waits: a due user starts it.
            (0, later, 0, no, true, Some(UserDue)),
            (0, later, NOW, yes, true, Some(UserDue)),
            (0, later, 0, yes, false, None),
        ];
        for (failures, next, last_wake, heard, due, expected) in table {
            assert_eq!(
                wake_reason(&wait(failures, next, last_wake), NOW, MIN_GAP, heard, due),
                expected,
                "failures {failures}, next {next}, last wake {last_wake}, heard {heard:?}, due {due}"
            );
        }
    }

    #[test]
    fn notes_coalesce_and_remember_hearing() {
        let wakeups = Wakeups::default();
        let a = <&ServerName>::try_from("a.example").unwrap();
        let b = <&ServerName>::try_from("b.example").unwrap();
        wakeups.note_all([(a, false)]);
        wakeups.note_all([(a, true)]);
        wakeups.note_all([(a, false), (b, false)]);
        let taken = wakeups.take();
        assert_eq!(taken.len(), 2);
        assert!(taken.get(a).is_some_and(|at| at.is_some()));
        assert_eq!(taken.get(b), Some(&None));
        assert!(wakeups.take().is_empty());
    }
}
