//! The health listener (SPEC §7): `/healthz` and `/readyz`.

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::store::Store;

/// What readiness depends on.
#[derive(Clone)]
pub struct Health {
    /// The NATS connection.
    pub nats: async_nats::Client,
    /// The database.
    pub store: Store,
}

/// The router.
pub fn router(health: Health) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(health)
}

async fn ready(State(health): State<Health>) -> (StatusCode, &'static str) {
    let nats = health.nats.connection_state() == async_nats::connection::State::Connected;
    let db = health.store.ping().await;
    match (nats, db) {
        (true, true) => (StatusCode::OK, "ready\n"),
        (false, _) => (StatusCode::SERVICE_UNAVAILABLE, "nats unavailable\n"),
        (true, false) => (StatusCode::SERVICE_UNAVAILABLE, "database unavailable\n"),
    }
}

/// Serves until `shutdown` turns true.
pub async fn serve(listener: TcpListener, health: Health, mut shutdown: watch::Receiver<bool>) {
    let result = axum::serve(listener, router(health))
        .with_graceful_shutdown(async move {
            let _ = shutdown.wait_for(|stop| *stop).await;
        })
        .await;
    if let Err(e) = result {
        tracing::error!(error = %e, "http listener failed");
    }
}
