//! Batches gathered from a pull, and two of them in flight at once with
//! their order kept where it matters.

use std::time::Duration;

use async_nats::jetstream::Message;
use futures::StreamExt as _;
use tokio::sync::oneshot;
use tracing::Instrument as _;

use super::Ingest;
use crate::shutdown::Shutdown;
use crate::store::{Baton, Turn};

/// While no batch is in flight, how long a batch may gather what follows its
/// first message before it starts (a burst's messages arrive back to back).
const LINGER: Duration = Duration::from_millis(2);

/// A batch: `first` and what follows it, up to `max` messages. How long it
/// gathers adapts to the load, so a lone update goes through at once while
/// a burst still batches:
/// - while a batch is in flight, it gathers until that batch has finished
///   (it could not start sooner anyway) or it is full;
/// - while none is, it takes what arrives within [`LINGER`] of its first
///   message and goes.
///
/// Under a steady rate a batch therefore holds what arrived while the one
/// before it ran, not a fixed time's worth. A real await on the pull (not
/// `now_or_never`) matters: tokio's cooperative budget makes a bare poll
/// report "pending" after 128 receives, which would split batches into 128s.
pub(super) async fn gather<T, E, S>(
    first: T,
    pull: &mut S,
    max: usize,
    pipeline: &mut Pipeline,
) -> Vec<T>
where
    S: futures::Stream<Item = Result<T, E>> + Unpin,
{
    let mut chunk = vec![first];
    let linger_until = tokio::time::Instant::now() + LINGER;
    while chunk.len() < max {
        let next = if pipeline.is_busy() {
            tokio::select! {
                biased;
                next = pull.next() => next,
                () = pipeline.idle() => break,
            }
        } else {
            match tokio::time::timeout_at(linger_until, pull.next()).await {
                Ok(next) => next,
                Err(_) => break,
            }
        };
        match next {
            Some(Ok(message)) => chunk.push(message),
            _ => break,
        }
    }
    chunk
}

/// A batch's place in the pipeline.
pub(super) struct Order {
    /// Its database turn after the previous batch.
    pub(super) turn: Turn,
    /// Resolves when the previous batch has finished (acked or naked).
    pub(super) previous_done: Option<oneshot::Receiver<()>>,
    /// Told when this batch has finished.
    pub(super) done: oneshot::Sender<()>,
}

/// Two batches in flight: while one commits, hands its events over and acks,
/// the next is checked, locked, loaded and written. Their order is kept
/// where it matters: user locks in batch order, commits in batch order (a
/// batch whose predecessor failed rolls back and tries again after it), and
/// acks and events in batch order.
#[derive(Default)]
pub(super) struct Pipeline {
    in_flight: Option<tokio::task::JoinHandle<()>>,
    baton: Option<Baton>,
    done: Option<oneshot::Receiver<()>>,
}

impl Pipeline {
    /// Starts `batch` after the batches already pushed; returns once at
    /// most one batch (this one) is still in flight.
    pub(super) async fn push(&mut self, ingest: &Ingest, batch: Vec<Message>, shutdown: &Shutdown) {
        let (turn, baton) = Turn::after(self.baton.take());
        let (done_tx, done_rx) = oneshot::channel();
        let order = Order {
            turn,
            previous_done: self.done.replace(done_rx),
            done: done_tx,
        };
        self.baton = Some(baton);
        let ingest = ingest.clone();
        let shutdown = shutdown.clone();
        // `users` and `user` (the first one, to find a user's batch in a
        // trace search) are recorded once the messages are parsed.
        let span = tracing::info_span!(
            "batch",
            messages = batch.len(),
            users = tracing::field::Empty,
            user = tracing::field::Empty,
        );
        let task = tokio::spawn(
            async move { ingest.process(batch, &shutdown, order).await }.instrument(span),
        );
        if let Some(previous) = self.in_flight.replace(task) {
            let _ = previous.await;
        }
    }

    /// Whether a pushed batch has not finished yet.
    pub(super) fn is_busy(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Waits until the batch in flight has finished. Cancel-safe: a wait cut
    /// short leaves the batch in flight.
    pub(super) async fn idle(&mut self) {
        if let Some(task) = &mut self.in_flight {
            let _ = task.await;
            self.in_flight = None;
        }
    }

    /// Waits until every pushed batch has finished.
    pub(super) async fn finish(&mut self) {
        if let Some(last) = self.in_flight.take() {
            let _ = last.await;
        }
        self.baton = None;
        self.done = None;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::StreamExt as _;
    use futures::channel::mpsc;
    use tokio::sync::oneshot;

    use super::{LINGER, Pipeline, gather};

    /// A pull whose messages the test sends.
    fn pull() -> (
        mpsc::UnboundedSender<u32>,
        impl futures::Stream<Item = Result<u32, ()>> + Unpin,
    ) {
        let (tx, rx) = mpsc::unbounded();
        (tx, rx.map(Ok))
    }

    /// A pipeline with a batch in flight until the sender is used or dropped.
    fn busy() -> (Pipeline, oneshot::Sender<()>) {
        let (tx, rx) = oneshot::channel::<()>();
        let pipeline = Pipeline {
            in_flight: Some(tokio::spawn(async move {
                let _ = rx.await;
            })),
            ..Pipeline::default()
        };
        (pipeline, tx)
    }

    /// Sends a message every `every` from a task.
    fn steady(tx: mpsc::UnboundedSender<u32>, every: Duration) {
        tokio::spawn(async move {
            for n in 1.. {
                tokio::time::sleep(every).await;
                if tx.unbounded_send(n).is_err() {
                    break;
                }
            }
        });
    }

    /// Nothing in flight and a steady trickle closer than [`LINGER`]: the
    /// batch still starts [`LINGER`] after its first message; it does not
    /// wait for a gap that never comes.
    #[tokio::test(start_paused = true)]
    async fn idle_starts_within_linger() {
        let (tx, mut pull) = pull();
        let mut pipeline = Pipeline::default();
        steady(tx, Duration::from_micros(500));
        let started = tokio::time::Instant::now();
        let batch = gather(0, &mut pull, 1000, &mut pipeline).await;
        assert!(started.elapsed() <= LINGER + Duration::from_millis(1));
        assert!(batch.len() <= 6, "{} messages", batch.len());
    }

    /// Nothing in flight and nothing else arriving: a lone update goes on
    /// alone.
    #[tokio::test(start_paused = true)]
    async fn lone_message_goes_alone() {
        let (_tx, mut pull) = pull();
        let mut pipeline = Pipeline::default();
        assert_eq!(gather(7, &mut pull, 1000, &mut pipeline).await, [7]);
    }

    /// A batch in flight: the next one gathers until it has finished (it
    /// could not start sooner), however long that is, then goes at once.
    #[tokio::test(start_paused = true)]
    async fn busy_gathers_until_the_batch_in_flight_ends() {
        let (tx, mut pull) = pull();
        let (mut pipeline, finish) = busy();
        steady(tx, Duration::from_millis(1));
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let _ = finish.send(());
        });
        let batch = gather(0, &mut pull, 1000, &mut pipeline).await;
        assert!((45..=55).contains(&batch.len()), "{} messages", batch.len());
        assert!(
            !pipeline.is_busy(),
            "the finished batch is no longer in flight"
        );
    }

    /// A burst while a batch is in flight: the next batch fills up to its
    /// size and goes without waiting for the one in flight.
    #[tokio::test(start_paused = true)]
    async fn burst_fills_the_batch() {
        let (tx, mut pull) = pull();
        let (mut pipeline, _finish) = busy();
        for n in 1..5000 {
            let _ = tx.unbounded_send(n);
        }
        let batch = gather(0, &mut pull, 1000, &mut pipeline).await;
        assert_eq!(batch.len(), 1000);
        assert!(pipeline.is_busy());
    }
}
