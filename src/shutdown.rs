//! One stop signal for every task of a worker, and a drop guard for tasks
//! spawned on the side (the model is mini-redis's `shutdown.rs`).
//!
//! [`Shutdown::new`] gives the trigger, kept by whoever decides to stop, and
//! a [`Shutdown`] that every task clones. A task asks
//! [`Shutdown::is_requested`] between steps, and awaits
//! [`Shutdown::requested`] where it would otherwise wait for something else
//! (a `select!` arm). A dropped trigger counts as a request, so a worker whose
//! owner went away stops too.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinHandle};

/// Tells every [`Shutdown`] made with it to stop.
#[derive(Debug)]
pub struct ShutdownTrigger(watch::Sender<bool>);

impl ShutdownTrigger {
    /// Requests the stop (idempotent).
    pub fn trigger(&self) {
        self.0.send_replace(true);
    }
}

/// A task's view of the stop signal. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    /// A new signal: the trigger and the first receiver.
    pub fn new() -> (ShutdownTrigger, Shutdown) {
        let (tx, rx) = watch::channel(false);
        (ShutdownTrigger(tx), Shutdown(rx))
    }

    /// Whether the stop was requested (or its trigger dropped).
    pub fn is_requested(&self) -> bool {
        *self.0.borrow() || self.0.has_changed().is_err()
    }

    /// Resolves once the stop is requested (at once if it already was).
    pub async fn requested(&self) {
        let mut rx = self.0.clone();
        // An error means the trigger is gone: that is a stop too.
        let _ = rx.wait_for(|stop| *stop).await;
    }

    /// Runs `step` until it succeeds (its value) or the stop is requested
    /// (None), logging each failure as "cannot `what`" and waiting longer
    /// after each (from [`RETRY_FIRST`] to [`RETRY_MAX`]). For work whose
    /// result is committed elsewhere and that nothing else would redo.
    pub async fn retry<T, E, F>(&self, what: &str, mut step: impl FnMut() -> F) -> Option<T>
    where
        E: std::fmt::Display,
        F: Future<Output = Result<T, E>>,
    {
        let mut wait = RETRY_FIRST;
        loop {
            match step().await {
                Ok(value) => return Some(value),
                Err(e) => tracing::warn!(error = %e, ?wait, "cannot {what}; retrying"),
            }
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = self.requested() => return None,
            }
            wait = (wait * 2).min(RETRY_MAX);
        }
    }
}

/// The first wait of [`Shutdown::retry`].
pub const RETRY_FIRST: Duration = Duration::from_millis(100);
/// The longest wait of [`Shutdown::retry`].
pub const RETRY_MAX: Duration = Duration::from_secs(5);

/// Aborts a spawned task when dropped, so a task that serves one owner (a
/// lease renewer, a job's progress acks) never outlives it, on every way out.
#[derive(Debug)]
pub struct AbortOnDrop(AbortHandle);

impl AbortOnDrop {
    /// Spawns `task` and ties it to the returned guard.
    pub fn spawn<F>(task: F) -> AbortOnDrop
    where
        F: Future<Output = ()> + Send + 'static,
    {
        AbortOnDrop::from(tokio::spawn(task))
    }
}

impl From<JoinHandle<()>> for AbortOnDrop {
    fn from(handle: JoinHandle<()>) -> Self {
        AbortOnDrop(handle.abort_handle())
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn trigger_reaches_every_clone_and_a_dropped_trigger_stops_too() {
        let (trigger, shutdown) = Shutdown::new();
        let other = shutdown.clone();
        assert!(!shutdown.is_requested());
        trigger.trigger();
        assert!(other.is_requested());
        tokio::time::timeout(Duration::from_secs(5), other.requested())
            .await
            .expect("requested resolves after the trigger");

        let (trigger, shutdown) = Shutdown::new();
        drop(trigger);
        assert!(shutdown.is_requested());
        tokio::time::timeout(Duration::from_secs(5), shutdown.requested())
            .await
            .expect("requested resolves once the trigger is gone");
    }

    #[tokio::test]
    async fn the_guard_aborts_its_task() {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
        let guard = AbortOnDrop::spawn(async move {
            let _tx = tx;
            std::future::pending::<()>().await;
        });
        drop(guard);
        // The task's sender is dropped only when the task is aborted.
        let closed = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await;
        assert_eq!(closed, Ok(None));
    }
}
