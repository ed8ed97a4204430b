//! The revalidation pacer (SPEC §5.7): picks users whose list was last
//! fetched longer ago than `DLU_REVALIDATE_AFTER`, oldest first, at the rate
//! [`crate::decide::revalidate`] allows, and hands their servers to the
//! fetch queue; the servers' fetch jobs run them after their stale users.
//!
//! One replica paces at a time, the holder of the `revalidation` lease in
//! the lease bucket, so the rate is the deployment's whatever the number of
//! replicas; another takes over when it stops or dies. The population (the
//! tracked users the rate is spread over) is counted again every ten seconds
//! (every second while there are none).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv;
use ruma::OwnedServerName;

use super::queue::FetchQueue;
use crate::bus::lease::Lease;
use crate::decide::revalidate::{Pacer, RECOUNT_EMPTY, rate_per_second, recount_after};
use crate::faults::{Fault, Faults};
use crate::shutdown::Shutdown;
use crate::store::{Store, now_ms};

/// The lease key of the pacer.
pub const LEASE_KEY: &str = "revalidation";
/// How often the pacer picks users.
const TICK: Duration = Duration::from_millis(100);

/// The pacer of one replica (it paces only while it holds the lease).
pub(crate) struct Revalidator {
    /// The database.
    pub store: Store,
    /// Where the picked users' servers go.
    pub queue: FetchQueue,
    /// `DLU_REVALIDATE_AFTER` (not zero: a zero period starts no pacer).
    pub after: Duration,
    /// The lease bucket.
    pub leases: kv::Store,
    /// This replica's id, as the lease's value.
    pub replica: String,
    /// The lease length.
    pub lease_ttl: Duration,
    /// Injected faults (test builds only).
    pub faults: Faults,
}

impl Revalidator {
    /// Takes the lease when free and paces while holding it, until
    /// `shutdown`; then gives the lease up.
    pub async fn run(self, shutdown: Shutdown) {
        while !shutdown.is_requested() {
            let lease =
                Lease::try_acquire(&self.leases, LEASE_KEY, &self.replica, self.lease_ttl).await;
            if let Some(lease) = lease {
                tracing::info!(after = ?self.after, "pacing revalidations");
                self.pace(&lease, &shutdown).await;
                lease.release().await;
                continue;
            }
            // Another replica paces; look again within a lease length.
            tokio::select! {
                () = tokio::time::sleep(self.lease_ttl / 2) => {}
                () = shutdown.requested() => return,
            }
        }
    }

    /// Picks due users tick by tick while `lease` holds.
    async fn pace(&self, lease: &Lease, shutdown: &Shutdown) {
        let mut pacer = Pacer::default();
        let mut rate = 0.0;
        let mut counted: Option<Instant> = None;
        let mut recount = RECOUNT_EMPTY;
        let mut last = Instant::now();
        // Servers of revalidations queued whose jobs were not enqueued:
        // enqueued on each tick until they are (nothing else would).
        let mut unqueued: BTreeSet<OwnedServerName> = BTreeSet::new();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !lease.is_lost() {
            tokio::select! {
                _ = tick.tick() => {}
                () = shutdown.requested() => return,
            }
            if !unqueued.is_empty() {
                match self.queue.stale(&unqueued).await {
                    Ok(()) => unqueued.clear(),
                    Err(e) => {
                        tracing::warn!(error = %e, "revalidation jobs not enqueued; retrying")
                    }
                }
            }
            if counted.is_none_or(|at| at.elapsed() >= recount) {
                let started = Instant::now();
                match self.store.revalidation_population().await {
                    Ok(tracked) => {
                        rate = rate_per_second(tracked, self.after);
                        counted = Some(Instant::now());
                        recount = recount_after(tracked, started.elapsed());
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot count tracked users"),
                }
            }
            let now = Instant::now();
            let n = pacer.take(rate, now - last);
            last = now;
            if n == 0 {
                continue;
            }
            if let Err(e) = self.pick(n, &mut unqueued).await {
                tracing::warn!(error = %e, "revalidations not queued; trying again");
            }
        }
        tracing::warn!("revalidation lease lost; another replica paces");
    }

    /// Queues up to `n` due users and has their servers' jobs run; the
    /// servers whose jobs were not enqueued go into `unqueued`.
    async fn pick(
        &self,
        n: u64,
        unqueued: &mut BTreeSet<OwnedServerName>,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let now = now_ms();
        let after = i64::try_from(self.after.as_millis()).unwrap_or(i64::MAX);
        let servers = self
            .store
            .queue_revalidations(now.saturating_sub(after), now, n)
            .await?;
        if servers.is_empty() {
            return Ok(());
        }
        let queued = if self.faults.is_armed(Fault::FailRevalidationEnqueue) {
            Err("fault injection: the picked servers' jobs were not enqueued".into())
        } else {
            self.queue.stale(&servers).await.map_err(Into::into)
        };
        // The rows are committed: their servers' jobs are enqueued later.
        if queued.is_err() {
            unqueued.extend(servers);
        }
        queued
    }
}
