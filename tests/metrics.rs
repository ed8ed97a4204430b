//! `/metrics`: the counters move when work is done, and the scrape-time
//! gauges read the shared state.

mod common;

use std::time::Duration;

use common::{Backend, Nats, TestDb, publish};
use device_list_updater::testkit::remote::{MockFederation, Reply, device_list};
use device_list_updater::worker;
use serde_json::json;

const ALICE: &str = "@alice:remote.example";

async fn metrics_follow_the_work(backend: Backend) {
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let mut config = common::config(&nats, &db);
    let fleet = MockFederation::trusting(&config, Duration::ZERO).await;
    fleet.serve(&mut config, ["remote.example"]);
    fleet.script(
        ALICE,
        vec![Reply::Json(device_list(ALICE, 4, &[("D1", "Phone")]))],
    );
    let running = worker::start(config).await.unwrap();
    let js = nats.js().await;
    publish(&js, "devicelist.in.update", "not json", None).await;
    publish(
        &js,
        "devicelist.in.resync",
        &json!({"user_id": ALICE}).to_string(),
        None,
    )
    .await;

    let text = common::eventually(Duration::from_secs(20), "metrics settle", || async {
        let (status, text) = common::http_get(running.http_addr, "/metrics").await;
        assert_eq!(status, 200);
        let done = common::metric_sample(&text, "dlu_key_changes_published_total") == Some(1.0)
            && common::metric_sample(&text, "dlu_stale_users") == Some(0.0)
            && common::metric_sample(&text, "dlu_outbox_backlog") == Some(0.0)
            // The job is acked just after the list is stored.
            && common::metric_sample(&text, "dlu_fetch_jobs_pending") == Some(0.0);
        done.then_some(text)
    })
    .await;
    let expect = [
        ("dlu_updates_total{outcome=\"resync_requested\"}", 1.0),
        ("dlu_dead_letters_total{reason=\"not_json\"}", 1.0),
        (
            "dlu_fetches_total{outcome=\"stored\",server=\"remote.example\"}",
            1.0,
        ),
        (
            "dlu_federation_request_seconds_count{outcome=\"stored\"}",
            1.0,
        ),
        (
            "dlu_update_to_key_change_seconds_count{source=\"fetch\"}",
            1.0,
        ),
        ("dlu_fetch_jobs_pending", 0.0),
        ("dlu_fetches_in_flight", 0.0),
        ("dlu_outbound_refused_total", 0.0),
    ];
    for (name, value) in expect {
        assert_eq!(
            common::metric_sample(&text, name),
            Some(value),
            "{name} in\n{text}"
        );
    }
    running.stop(Duration::from_secs(10)).await;
}
both_backends!(follow, metrics_follow_the_work);

/// The latency histogram has one observation per update, not one per
/// batch: five updates published before the worker starts (so they are
/// applied together) are five observations.
async fn latency_per_update(backend: Backend) {
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let store = worker::open_store(&db.url, Duration::from_secs(10))
        .await
        .unwrap();
    let users: Vec<String> = (0..5).map(|n| format!("@user{n}:remote.example")).collect();
    for user in &users {
        common::known_user(store.connection(), user).await;
    }
    let js = nats.js().await;
    device_list_updater::testkit::create_input_stream(&js).await;
    for user in &users {
        let update = json!({"user_id": user, "device_id": "DEV", "stream_id": 1, "prev_id": [0],
            "keys": {"user_id": user, "device_id": "DEV", "algorithms": [],
                     "keys": {"ed25519:DEV": "key"}, "signatures": {}}});
        publish(&js, "devicelist.in.update", &update.to_string(), None).await;
    }
    let running = worker::start(common::config(&nats, &db)).await.unwrap();
    let text = common::eventually(Duration::from_secs(20), "five key changes", || async {
        let (_, text) = common::http_get(running.http_addr, "/metrics").await;
        (common::metric_sample(&text, "dlu_key_changes_published_total") == Some(5.0))
            .then_some(text)
    })
    .await;
    assert_eq!(
        common::metric_sample(
            &text,
            "dlu_update_to_key_change_seconds_count{source=\"update\"}"
        ),
        Some(5.0),
        "{text}"
    );
    running.stop(Duration::from_secs(10)).await;
}
both_backends!(per_update, latency_per_update);
