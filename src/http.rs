//! The health and metrics listener (SPEC §7): `/healthz`, `/readyz` and
//! `/metrics` (Prometheus text format; see `docs/metrics.md`).

use crate::shutdown::Shutdown;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::net::TcpListener;

use std::sync::Arc;

use async_nats::jetstream::consumer::PullConsumer;

use crate::bus::fetch_jobs::FETCH_CONSUMER;
use crate::bus::streams::FETCH_STREAM;
use crate::fetch::federation::FederationClient;
use crate::metrics::Metrics;
use crate::store::Store;

/// What readiness and the metrics depend on.
#[derive(Clone)]
pub struct Health {
    /// The NATS connection.
    pub nats: async_nats::Client,
    /// JetStream (pending fetch jobs).
    pub js: async_nats::jetstream::Context,
    /// The database.
    pub store: Store,
    /// Counters and histograms.
    pub metrics: Metrics,
    /// The federation client (the guard's refusal count).
    pub federation: Arc<FederationClient>,
    /// Found at start-up, shown by `/readyz` (streams with too few replicas).
    pub warnings: Arc<Vec<String>>,
}

/// The router.
pub fn router(health: Health) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(health)
}

/// How long `/readyz` waits for the database. With the server gone (not
/// refusing, gone) a ping would otherwise wait for the pool's whole acquire
/// timeout, and a probe gives up long before that.
const READY_PING: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether NATS and the database answer, as `/readyz` and `dlu_ready` say.
async fn answering(health: &Health) -> (bool, bool) {
    let nats = health.nats.connection_state() == async_nats::connection::State::Connected;
    let db = tokio::time::timeout(READY_PING, health.store.ping())
        .await
        .unwrap_or(false);
    (nats, db)
}

async fn ready(State(health): State<Health>) -> (StatusCode, String) {
    let (nats, db) = answering(&health).await;
    let (status, state) = match (nats, db) {
        (true, true) => (StatusCode::OK, "ready"),
        (false, _) => (StatusCode::SERVICE_UNAVAILABLE, "nats unavailable"),
        (true, false) => (StatusCode::SERVICE_UNAVAILABLE, "database unavailable"),
    };
    let mut body = format!("{state}\n");
    for warning in health.warnings.iter() {
        body.push_str(&format!("warning: {warning}\n"));
    }
    (status, body)
}

/// Refreshes the scrape-time gauges and renders every metric. A source that
/// does not answer leaves its gauge at the last value.
async fn metrics(State(health): State<Health>) -> impl axum::response::IntoResponse {
    let now = crate::store::now_ms();
    let fetch_jobs = async {
        let stream = health.js.get_stream(FETCH_STREAM).await.ok()?;
        let mut consumer: PullConsumer = stream.get_consumer(FETCH_CONSUMER).await.ok()?;
        let info = consumer.info().await.ok()?;
        Some(info.num_pending + info.num_ack_pending as u64)
    }
    .await;
    let (nats, db) = answering(&health).await;
    health.metrics.set_state(crate::metrics::SharedState {
        ready: Some(nats && db),
        tracked_users: match health.store.membership() {
            true => health.store.tracked_user_count().await.ok(),
            false => None,
        },
        stale_users: health.store.stale_user_count().await.ok(),
        outbox_backlog: health.store.outbox_len().await.ok(),
        fetch_jobs,
        users_backing_off: health.store.users_backing_off(now).await.ok(),
        servers_backing_off: health.store.servers_backing_off(now).await.ok(),
        revalidations_queued: health.store.queued_revalidation_count().await.ok(),
    });
    health
        .metrics
        .set_outbound_refused(health.federation.refused_connections());
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        health.metrics.render(),
    )
}

/// Serves until `shutdown` turns true.
pub async fn serve(listener: TcpListener, health: Health, shutdown: Shutdown) {
    let result = axum::serve(listener, router(health))
        .with_graceful_shutdown(async move {
            shutdown.requested().await;
        })
        .await;
    if let Err(e) = result {
        tracing::error!(error = %e, "http listener failed");
    }
}
