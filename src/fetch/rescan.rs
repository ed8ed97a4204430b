//! The start-up rescan (SPEC §5.2): every server that still has stale users
//! or queued revalidations is handed to the fetch queue (a parked job with a
//! user due runs now), spread evenly over `DLU_STARTUP_SPREAD` so a restart
//! does not hit every remote server at once. Jobs already queued are
//! refused by the stream, so replicas starting together do no double work.
//!
//! Nothing else enqueues these servers' jobs when their queue was lost, so
//! a failure (the database or JetStream not answering yet, a leader
//! election) is retried until it succeeds or the worker stops
//! ([`Shutdown::retry`]).

use std::time::Duration;

use ruma::OwnedServerName;
use sea_orm::DbErr;

use super::queue::FetchQueue;
use super::wake::WakeError;
use crate::bus::BusError;
use crate::faults::{Fault, Faults};
use crate::shutdown::Shutdown;
use crate::store::Store;

/// Runs the start-up rescan; see the module's documentation.
pub(crate) async fn rescan_stale(
    queue: FetchQueue,
    store: Store,
    spread: Duration,
    stop: Shutdown,
    faults: Faults,
) {
    let Some(servers) = stop
        .retry("read the servers of the start-up rescan", || {
            servers_to_rescan(&store)
        })
        .await
    else {
        return;
    };
    if servers.is_empty() {
        return;
    }
    tracing::info!(
        servers = servers.len(),
        ?spread,
        "fetching users still stale from before the start"
    );
    // Injected, the first enqueue fails.
    let mut fail_first = faults.is_armed(Fault::FailRescanEnqueue);
    let step = spread / u32::try_from(servers.len()).unwrap_or(u32::MAX);
    for (i, server) in servers.iter().enumerate() {
        if i > 0 && !step.is_zero() {
            // Pacing, not synchronisation: the spread is the point.
            tokio::select! {
                () = tokio::time::sleep(step) => {}
                () = stop.requested() => return,
            }
        }
        let enqueued = stop
            .retry("enqueue a job of the start-up rescan", || {
                let fail = std::mem::take(&mut fail_first);
                let queue = &queue;
                async move {
                    if fail {
                        return Err(WakeError::Bus(BusError::NotApplied(
                            "fault injection: the rescan's enqueue failed".into(),
                        )));
                    }
                    queue.stale([server]).await
                }
            })
            .await;
        if enqueued.is_none() {
            return;
        }
    }
}

/// Every server with stale users or queued revalidations, once each.
async fn servers_to_rescan(store: &Store) -> Result<Vec<OwnedServerName>, DbErr> {
    let mut servers = store.servers_with_stale_users().await?;
    servers.extend(store.servers_with_revalidations().await?);
    servers.sort_unstable();
    servers.dedup();
    Ok(servers
        .into_iter()
        .filter_map(|s| OwnedServerName::try_from(s).ok())
        .collect())
}
