//! `DLU_STREAM_REPLICAS` (SPEC §3): streams the worker finds with fewer
//! replicas than configured are left as they are, and said so in the log
//! and in `/readyz`'s body. (Creating streams with three replicas needs a
//! cluster; this checks the single-node side.)

mod common;

use std::time::Duration;

use common::{Backend, Nats, TestDb};
use device_list_updater::worker;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_with_too_few_replicas_are_reported() {
    let nats = Nats::start().await;
    let db = TestDb::new(Backend::Sqlite).await;
    // A first start creates every stream and the lease bucket, one replica.
    let config = common::config(&nats, &db);
    let first = worker::start(config.clone()).await.expect("first start");
    let (status, body) = common::http_get(first.http_addr, "/readyz").await;
    assert_eq!(
        (status, body.as_str()),
        (200, "ready\n"),
        "nothing to say at 1"
    );
    first.stop(Duration::from_secs(10)).await;

    // Configured for a cluster, on the same streams: ready, with a warning
    // per stream in use, and nothing changed.
    let mut clustered = config;
    clustered.settings.stream_replicas = 3;
    let second = worker::start(clustered)
        .await
        .expect("starts on R1 streams");
    let (status, body) = common::http_get(second.http_addr, "/readyz").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.starts_with("ready\n"), "{body}");
    for stream in [
        "DEVICE_LIST_INPUT",
        "KEY_CHANGE",
        "DEVICE_LIST_DEAD",
        "DEVICE_LIST_FETCH",
        "KV_device_list_updater_leases",
    ] {
        let line =
            format!("warning: stream {stream} has 1 replica(s), fewer than DLU_STREAM_REPLICAS=3");
        assert!(body.contains(&line), "no warning for {stream}:\n{body}");
    }
    let js = nats.js().await;
    let mut key_change = js.get_stream("KEY_CHANGE").await.expect("stream");
    let info = key_change.info().await.expect("info");
    assert!(info.config.num_replicas <= 1, "the stream was not changed");
    second.stop(Duration::from_secs(10)).await;
}
