//! Room sweeps (SPEC §5.5.5): when our server joins or leaves a room, every
//! remote member's sharing is re-decided, in bounded chunks of its own
//! transactions, so a room of tens of thousands of members never holds up
//! other input for long. The pending sweep is a flag on the room row set
//! in the transaction that changed the room, so a sweep cut short by a
//! crash resumes after the restart (this task looks at start-up, when a
//! batch says so, and every few seconds).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::faults::{Fault, Faults};
use crate::fetch::queue::FetchQueue;
use crate::metrics::Metrics;
use crate::shutdown::Shutdown;
use crate::store::{Store, now_ms};

/// How often rooms left to sweep are looked for without being told (a
/// replica may have died half-way through one).
const LOOK_EVERY: Duration = Duration::from_secs(5);

/// The sweeping task of one replica. Replicas may sweep the same room at
/// once: each chunk takes the room's and its users' locks, so they only
/// share the work.
pub(crate) struct Sweeper {
    /// The database.
    pub store: Store,
    /// Where the servers of users that start sharing go (SPEC §5.2).
    pub queue: FetchQueue,
    /// Told by ingest when a batch leaves a room to sweep.
    pub wake: Arc<Notify>,
    /// Counters.
    pub metrics: Metrics,
    /// Fault injection for the crash tests.
    pub faults: Faults,
}

impl Sweeper {
    /// Sweeps until `shutdown`.
    pub async fn run(self, shutdown: Shutdown) {
        while !shutdown.is_requested() {
            if let Err(e) = self.sweep_all(&shutdown).await {
                tracing::warn!(error = %e, "room sweep failed; trying again");
            }
            tokio::select! {
                () = self.wake.notified() => {}
                () = tokio::time::sleep(LOOK_EVERY) => {}
                () = shutdown.requested() => return,
            }
        }
    }

    async fn sweep_all(&self, shutdown: &Shutdown) -> Result<(), sea_orm::DbErr> {
        if self.faults.is_armed(Fault::HoldSweeps) {
            return Ok(());
        }
        for room in self.store.rooms_to_sweep().await? {
            let started = std::time::Instant::now();
            let mut untracked = 0;
            loop {
                let chunk = self.store.sweep_room(&room, now_ms()).await?;
                self.faults.crash_point(Fault::CrashAfterSweepChunk);
                untracked += chunk.plan.rooms.untrack.len();
                self.metrics.untracked(chunk.plan.rooms.untrack.len());
                let servers = &chunk.plan.fetch_servers;
                while !servers.is_empty() {
                    match self.queue.stale(servers).await {
                        Ok(()) => break,
                        // The stale marks are committed; the start-up
                        // rescan finds them if this never succeeds.
                        Err(e) if shutdown.is_requested() => {
                            tracing::warn!(error = %e, "fetch jobs of a sweep not enqueued");
                            break;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "fetch jobs of a sweep not enqueued; retrying");
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                    }
                }
                if chunk.done || shutdown.is_requested() {
                    break;
                }
                // Other writers (ingest) get their turn between chunks.
                tokio::task::yield_now().await;
            }
            tracing::info!(%room, untracked, ms = started.elapsed().as_millis() as u64, "room swept");
        }
        Ok(())
    }
}
