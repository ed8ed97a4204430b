//! The fan-out gives way to ingest while the input stream has a backlog.
//!
//! Both run on the same cores. Input is what the homeserver's sync workers
//! wait for (a room snapshot, a burst of updates), and a stale user's list
//! fetched a few seconds later is as good, so while ingest is behind, only
//! a few fetch jobs run at once and the rest wait until it has caught up
//! (a job that was running when the backlog began waits before its next
//! user). Behind means: within the last [`HOLD`], ingest gathered a batch
//! that was full or after which JetStream still had a batch's worth
//! pending. Without this, a snapshot that starts tracking thousands of
//! users is applied at half its speed, because the fetches it causes take
//! the CPU it needs (BENCHMARKS.md, membership snapshot), and its users are
//! fetched no sooner for it.
//!
//! Never zero: a backlog that does not end (input faster than this machine
//! applies it) slows the fan-out but does not stop it. Each replica gives
//! way to its own ingest only: a replica that does not hold the input
//! stream's lease fetches at full speed.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// One of the few turns to run while ingest is behind; held while it runs.
pub type Turn = OwnedSemaphorePermit;

/// How long one batch that found ingest behind counts as a backlog. A
/// burst's next batch comes well within it; once none has found ingest
/// behind for this long, the fan-out goes at full speed again.
pub const HOLD: Duration = Duration::from_millis(250);

/// Fetch jobs run at once while ingest is behind, per
/// [`SHARE`] of `DLU_FETCH_CONCURRENCY` (at least one).
const SHARE: usize = 64;

/// Shared by the ingest loop (which says when it is behind) and the fetch
/// jobs (which wait for a turn while it is behind).
#[derive(Clone)]
pub struct IngestBacklog {
    inner: Arc<Inner>,
}

struct Inner {
    /// When the backlog last seen ends, if it has not yet.
    behind_until: Mutex<Option<Instant>>,
    /// The turns while ingest is behind.
    slots: Arc<Semaphore>,
}

impl IngestBacklog {
    /// A backlog signal for a fetcher of `concurrency` servers at once:
    /// while ingest is behind, `concurrency / 64` jobs (at least one) run at
    /// once.
    pub fn new(concurrency: usize) -> IngestBacklog {
        IngestBacklog::with_slots((concurrency / SHARE).max(1))
    }

    /// As [`IngestBacklog::new`], with the number of turns while ingest is
    /// behind.
    pub fn with_slots(slots: usize) -> IngestBacklog {
        IngestBacklog {
            inner: Arc::new(Inner {
                behind_until: Mutex::new(None),
                slots: Arc::new(Semaphore::new(slots.max(1))),
            }),
        }
    }

    /// Ingest's word after gathering a batch: `behind` when more input was
    /// waiting than one batch holds.
    pub fn note_batch(&self, behind: bool) {
        if behind {
            *self.lock() = Some(Instant::now() + HOLD);
        }
    }

    /// Whether ingest is behind now.
    pub fn is_behind(&self) -> bool {
        self.behind_until().is_some()
    }

    fn behind_until(&self) -> Option<Instant> {
        let until = (*self.lock())?;
        (until > Instant::now()).then_some(until)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        // The value is a plain instant: a panic elsewhere cannot leave it
        // half-written.
        self.inner
            .behind_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a turn. `None`: ingest is not behind, go. `Some`: one of
    /// the few turns while it is; hold it while the work runs.
    /// Cancel-safe.
    pub async fn turn(&self) -> Option<Turn> {
        loop {
            let until = self.behind_until()?;
            tokio::select! {
                permit = self.inner.slots.clone().acquire_owned() => {
                    // The semaphore is never closed.
                    return permit.ok();
                }
                // The backlog may have ended (or been extended): look again.
                () = tokio::time::sleep_until(until) => {}
            }
        }
    }

    /// Before each step of work that began with or without a turn: while
    /// ingest is behind, a turn is needed (waited for if not held); once it
    /// is not, a held turn is let go for others. Cancel-safe.
    pub async fn keep_turn(&self, turn: &mut Option<Turn>) {
        if !self.is_behind() {
            *turn = None;
        } else if turn.is_none() {
            *turn = self.turn().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt as _;

    #[tokio::test(start_paused = true)]
    async fn no_backlog_no_wait() {
        let backlog = IngestBacklog::with_slots(1);
        backlog.note_batch(false);
        for _ in 0..10 {
            assert!(backlog.turn().now_or_never().expect("at once").is_none());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn behind_lets_a_few_through_and_the_rest_wait() {
        let backlog = IngestBacklog::with_slots(2);
        backlog.note_batch(true);
        let first = backlog
            .turn()
            .now_or_never()
            .expect("a slot")
            .expect("held");
        let _second = backlog
            .turn()
            .now_or_never()
            .expect("a slot")
            .expect("held");
        let mut third = Box::pin(backlog.turn());
        assert!((&mut third).now_or_never().is_none(), "a third must wait");
        // A job ends: the waiting one takes its turn.
        drop(first);
        assert!(third.now_or_never().expect("its turn").is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn the_backlog_ends_hold_after_the_last_full_batch() {
        let backlog = IngestBacklog::with_slots(1);
        backlog.note_batch(true);
        let _held = backlog.turn().await.expect("the one slot");
        let waiting = tokio::spawn({
            let backlog = backlog.clone();
            async move {
                backlog.turn().await;
                Instant::now()
            }
        });
        // Another full batch halfway through extends the backlog.
        tokio::time::sleep(HOLD / 2).await;
        let extended_at = Instant::now();
        backlog.note_batch(true);
        // Batches that are not full do not.
        backlog.note_batch(false);
        let went = waiting.await.expect("no panic");
        assert_eq!(went, extended_at + HOLD);
        assert!(!backlog.is_behind());
    }

    #[tokio::test(start_paused = true)]
    async fn keep_turn_waits_while_behind_and_lets_go_after() {
        let backlog = IngestBacklog::with_slots(1);
        // Not behind: no turn needed, none held.
        let mut first = None;
        backlog
            .keep_turn(&mut first)
            .now_or_never()
            .expect("at once");
        assert!(first.is_none());
        backlog.note_batch(true);
        backlog
            .keep_turn(&mut first)
            .now_or_never()
            .expect("a free turn");
        assert!(first.is_some());
        {
            let mut second = None;
            let waiting = backlog.keep_turn(&mut second).now_or_never();
            assert!(waiting.is_none(), "the only turn is held");
        }
        // The holder goes on without waiting.
        backlog.keep_turn(&mut first).now_or_never().expect("held");
        assert!(first.is_some());
        // Once ingest has caught up the turn is let go.
        tokio::time::sleep(HOLD).await;
        backlog
            .keep_turn(&mut first)
            .now_or_never()
            .expect("at once");
        assert!(first.is_none());
        assert_eq!(backlog.inner.slots.available_permits(), 1);
    }

    #[test]
    fn a_share_of_the_concurrency_never_zero() {
        let slots = |c| IngestBacklog::new(c).inner.slots.available_permits();
        assert_eq!(slots(1024), 16);
        assert_eq!(slots(64), 1);
        assert_eq!(slots(1), 1);
        assert_eq!(slots(0), 1);
    }
}
