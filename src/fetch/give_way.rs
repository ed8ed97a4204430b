//! The fan-out gives way to ingest while the input stream has a backlog.
//!
//! Both run on the same cores. Input is what the homeserver's sync workers
//! wait for (a room snapshot, a burst of updates), and a stale user's list
//! fetched a few seconds later is as good, so while ingest is behind, only
//! a few fetch jobs run at once and the rest wait until it has caught up
//! (a job that was running when the backlog began waits before its next
//! user). Without this, a snapshot that starts tracking thousands of users
//! is applied at half its speed, because the fetches it causes take the
//! CPU it needs (BENCHMARKS.md, membership snapshot), and its users are
//! fetched no sooner for it.
//!
//! Behind means: ingest gathered a batch that was full or after which
//! JetStream still had a batch's worth pending, and it has not since
//! gathered one that was neither, or did so less than [`HOLD`] ago. The
//! backlog lasts until ingest says otherwise, not for a fixed time after it
//! was seen, so a batch that takes long (a loaded machine, a slow commit)
//! does not let the fan-out loose half-way.
//!
//! At start-up ingest has not looked yet: until its first word (a first
//! batch, an empty pull, the consumer's pending count, or that another
//! replica holds the input lease; at most [`FIRST_WORD`]) the fan-out
//! counts it as behind, so fetch jobs that were waiting in the stream do not
//! all start ahead of a backlog nobody has measured.
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

/// How long the backlog still counts after ingest last said it is behind.
/// A burst's next full batch comes well within it; once ingest has said
/// otherwise for this long, the fan-out goes at full speed again.
pub const HOLD: Duration = Duration::from_millis(250);

/// The longest the fan-out waits at start-up for ingest's first word.
pub const FIRST_WORD: Duration = Duration::from_secs(5);

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
    state: Mutex<State>,
    /// The turns while ingest is behind.
    slots: Arc<Semaphore>,
}

/// What ingest has said so far.
struct State {
    /// When the backlog last seen ends, if it has not yet (at start-up: when
    /// the wait for ingest's first word ends).
    behind_until: Option<Instant>,
    /// [`Behind`] guards alive (one per ingest loop that is behind).
    held: usize,
    /// Whether ingest has said anything yet.
    heard: bool,
}

/// Held by an ingest loop while it knows it is behind: from a batch (or a
/// count of pending messages) that found a backlog until its next word.
/// The backlog lasts while one is held, and [`HOLD`] after.
#[must_use = "the backlog ends HOLD after this is dropped"]
pub struct Behind {
    backlog: IngestBacklog,
}

impl Drop for Behind {
    fn drop(&mut self) {
        let mut state = self.backlog.lock();
        state.held = state.held.saturating_sub(1);
        let until = Instant::now() + HOLD;
        state.behind_until = Some(state.behind_until.map_or(until, |u| u.max(until)));
    }
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
                state: Mutex::new(State {
                    behind_until: Some(Instant::now() + FIRST_WORD),
                    held: 0,
                    heard: false,
                }),
                slots: Arc::new(Semaphore::new(slots.max(1))),
            }),
        }
    }

    /// Ingest's word after gathering a batch: `behind` when more input was
    /// waiting than one batch holds. While it is, the caller holds the
    /// returned guard until its next word.
    pub fn note_batch(&self, behind: bool) -> Option<Behind> {
        let mut state = self.lock();
        if !state.heard {
            // The start-up wait ends with ingest's first word. Later, a
            // batch that finds nothing waiting does not end a backlog seen
            // before: that lasts its hold (a burst may pause for a moment).
            state.heard = true;
            state.behind_until = None;
        }
        if !behind {
            return None;
        }
        state.held += 1;
        drop(state);
        Some(Behind {
            backlog: self.clone(),
        })
    }

    /// Ingest's word when it has nothing to apply: an empty pull, or another
    /// replica holds the input lease.
    pub fn note_idle(&self) {
        drop(self.note_batch(false));
    }

    /// Whether ingest is behind now.
    pub fn is_behind(&self) -> bool {
        self.behind_until().is_some()
    }

    /// When to look again while ingest is behind; `None` when it is not.
    fn behind_until(&self) -> Option<Instant> {
        let state = self.lock();
        let now = Instant::now();
        if state.held > 0 {
            // Ends HOLD after the last guard: look again then at the earliest.
            return Some(now + HOLD);
        }
        state.behind_until.filter(|until| *until > now)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is plain values, each written whole: a panic elsewhere
        // cannot leave it half-written.
        self.inner
            .state
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

    /// A task that waits for a turn and says when it came.
    fn when_its_turn_comes(backlog: &IngestBacklog) -> tokio::task::JoinHandle<Instant> {
        let backlog = backlog.clone();
        tokio::spawn(async move {
            backlog.turn().await;
            Instant::now()
        })
    }

    #[tokio::test(start_paused = true)]
    async fn no_backlog_no_wait() {
        let backlog = IngestBacklog::with_slots(1);
        assert!(backlog.note_batch(false).is_none());
        for _ in 0..10 {
            assert!(backlog.turn().now_or_never().expect("at once").is_none());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn behind_lets_a_few_through_and_the_rest_wait() {
        let backlog = IngestBacklog::with_slots(2);
        let _behind = backlog.note_batch(true);
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
        drop(backlog.note_batch(true));
        let _held = backlog.turn().await.expect("the one slot");
        let waiting = when_its_turn_comes(&backlog);
        // Another full batch halfway through extends the backlog.
        tokio::time::sleep(HOLD / 2).await;
        let extended_at = Instant::now();
        drop(backlog.note_batch(true));
        // Batches that are not full, or an empty pull, do not end it.
        assert!(backlog.note_batch(false).is_none());
        backlog.note_idle();
        let went = waiting.await.expect("no panic");
        assert_eq!(went, extended_at + HOLD);
        assert!(!backlog.is_behind());
    }

    #[tokio::test(start_paused = true)]
    async fn the_backlog_lasts_until_ingest_says_otherwise() {
        let backlog = IngestBacklog::with_slots(1);
        let behind = backlog.note_batch(true);
        let _held = backlog.turn().await.expect("the one slot");
        let waiting = when_its_turn_comes(&backlog);
        // A slow batch: ingest says nothing for ten holds.
        tokio::time::sleep(HOLD * 10).await;
        assert!(backlog.is_behind(), "behind until ingest says otherwise");
        let applied_at = Instant::now();
        drop(behind);
        let went = waiting.await.expect("no panic");
        assert!(
            went >= applied_at + HOLD,
            "went {:?} early",
            applied_at + HOLD - went
        );
        assert!(went <= applied_at + HOLD * 2);
        assert!(!backlog.is_behind());
    }

    #[tokio::test(start_paused = true)]
    async fn at_start_up_ingest_counts_as_behind_until_its_first_word() {
        let backlog = IngestBacklog::with_slots(1);
        assert!(backlog.is_behind(), "nobody has looked yet");
        let _turn = backlog
            .turn()
            .now_or_never()
            .expect("a slot")
            .expect("a turn, not full speed");
        assert!(backlog.turn().now_or_never().is_none(), "one at a time");
        // Ingest found nothing waiting: full speed.
        backlog.note_idle();
        assert!(backlog.turn().now_or_never().expect("at once").is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn the_start_up_wait_ends_by_itself() {
        let backlog = IngestBacklog::with_slots(1);
        tokio::time::sleep(FIRST_WORD).await;
        assert!(!backlog.is_behind());
    }

    #[tokio::test(start_paused = true)]
    async fn keep_turn_waits_while_behind_and_lets_go_after() {
        let backlog = IngestBacklog::with_slots(1);
        backlog.note_idle();
        // Not behind: no turn needed, none held.
        let mut first = None;
        backlog
            .keep_turn(&mut first)
            .now_or_never()
            .expect("at once");
        assert!(first.is_none());
        drop(backlog.note_batch(true));
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
