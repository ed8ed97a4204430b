//! Asking for a user's list to be fetched again from outside the input
//! stream (the resync RPC of SPEC §4.4, `admin resync`): the stale mark a
//! `devicelist.in.resync` message makes, then its server's fetch job.

use ruma::OwnedUserId;

use super::queue::FetchQueue;
use super::wake::WakeError;
use crate::decide::Outcome;
use crate::input::{InputMessage, ResyncRequest};
use crate::store::{Store, now_ms};

/// Why a resync could not be requested.
#[derive(Debug, thiserror::Error)]
pub enum ResyncError {
    /// The stale mark was not stored.
    #[error("database: {0}")]
    Database(#[from] sea_orm::DbErr),
    /// The fetch job was not enqueued or started (the mark is stored; a
    /// restart's rescan finds it).
    #[error(transparent)]
    Queue(#[from] WakeError),
    /// The task storing the request ended without an answer (it panicked
    /// or the runtime is shutting down).
    #[error("the resync request was interrupted: {0}")]
    Interrupted(String),
}

/// What a resync request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Requested {
    /// The user is marked stale and its server's job is queued.
    MarkedStale,
    /// The user shares no room with us (SPEC §5.5.6): nothing is fetched.
    Untracked,
}

/// Marks `user` stale and hands its server to the fetch queue; a worker
/// fetches it. The same rules as a `devicelist.in.resync` message decide.
pub async fn request(
    store: &Store,
    queue: &FetchQueue,
    user: &OwnedUserId,
) -> Result<Requested, ResyncError> {
    let mark = [InputMessage::Resync(ResyncRequest {
        user_id: user.clone(),
    })];
    let applied = store.apply_batch(&mark, now_ms()).await?;
    if applied.plan.outcomes.first() != Some(&Outcome::ResyncRequested) {
        return Ok(Requested::Untracked);
    }
    queue.stale(&applied.plan.fetch_servers).await?;
    Ok(Requested::MarkedStale)
}
