//! Start-up waits: NATS and the database may come up after the worker (a
//! compose file starts them together), so connecting is retried until
//! `DLU_STARTUP_TIMEOUT` has passed. Used by both connections; below every
//! other layer.

use std::future::Future;
use std::time::Duration;

/// Pause between two tries.
const PAUSE: Duration = Duration::from_millis(250);

/// Calls `attempt` until it succeeds or `wait` has passed, and returns the
/// last error then; an error for which `is_final` holds is returned at once
/// (waiting cannot mend it, such as refused credentials).
pub async fn retry_within_unless<T, E, F, Fut>(
    wait: Duration,
    mut attempt: F,
    is_final: impl Fn(&E) -> bool,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(e) if is_final(&e) || tokio::time::Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(PAUSE).await,
        }
    }
}
