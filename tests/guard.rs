//! The outbound guard: a remote user whose server name points at our own
//! machine (`@evil:127.0.0.1:PORT`, `@evil:localhost:PORT`) never makes us
//! connect there, unless the operator overrode that server.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{Backend, Nats, TestDb, publish};
use device_list_updater::fetch::federation::{FederationClient, FederationSettings};
use device_list_updater::server_key::ServerKey;
use device_list_updater::testkit::remote::{MockFederation, Reply, device_list, overrides_for};
use device_list_updater::worker;
use entity::stale_user;
use sea_orm::EntityTrait;
use serde_json::json;

/// A listener that counts connections and never answers.
async fn trap() -> (u16, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    tokio::spawn(async move {
        while let Ok((_socket, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
        }
    });
    (port, hits)
}

fn client(
    overrides: std::collections::BTreeMap<ruma::OwnedServerName, String>,
) -> FederationClient {
    FederationClient::new(FederationSettings {
        origin: common::OUR_SERVER.try_into().unwrap(),
        key: ServerKey::generate().unwrap().key_pair().unwrap(),
        overrides,
        timeout: Duration::from_secs(2),
    })
    .expect("client")
}

#[tokio::test]
async fn loopback_targets_are_refused_by_the_client() {
    let (port, hits) = trap().await;
    let client = client(Default::default());
    for user in [
        format!("@evil:127.0.0.1:{port}"),
        format!("@evil:localhost:{port}"),
        format!("@evil:[::1]:{port}"),
    ] {
        let user = ruma::OwnedUserId::try_from(user).unwrap();
        let error = client.get_devices(&user).await.expect_err("refused");
        assert!(error.reason.contains("refus"), "{user}: {}", error.reason);
    }
    assert_eq!(hits.load(Ordering::SeqCst), 0, "the trap was contacted");
    assert!(
        client.refused_connections() >= 1,
        "the DNS refusal is counted"
    );
}

#[tokio::test]
async fn an_override_may_point_at_loopback() {
    let key = ServerKey::generate().unwrap();
    let fleet = MockFederation::trusting_key(common::OUR_SERVER, &key, Duration::ZERO).await;
    let user = "@alice:127.0.0.1:1";
    fleet.script(user, vec![Reply::Json(device_list(user, 1, &[("D", "P")]))]);
    let client = FederationClient::new(FederationSettings {
        origin: common::OUR_SERVER.try_into().unwrap(),
        key: key.key_pair().unwrap(),
        overrides: overrides_for(&fleet, ["127.0.0.1:1"]),
        timeout: Duration::from_secs(2),
    })
    .unwrap();
    let user = ruma::OwnedUserId::try_from(user).unwrap();
    let (list, _) = client.get_devices(&user).await.expect("fetched");
    assert_eq!(list.devices.len(), 1);
    assert_eq!(fleet.bad_signatures(), 0);
}

/// End to end: the worker retries the evil users (they stay stale) and never
/// touches the trap, while a normal user is fetched.
async fn worker_never_contacts_loopback(backend: Backend) {
    let (port, hits) = trap().await;
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let mut config = common::config(&nats, &db);
    let fleet = MockFederation::trusting(&config, Duration::ZERO).await;
    fleet.serve(&mut config, ["good.example"]);
    let good = "@alice:good.example";
    fleet.script(good, vec![Reply::Json(device_list(good, 1, &[("D", "P")]))]);
    let worker = worker::start(config).await.unwrap();
    let js = nats.js().await;
    let evil = [
        format!("@evil:127.0.0.1:{port}"),
        format!("@evil:localhost:{port}"),
    ];
    for user in evil.iter().map(String::as_str).chain([good]) {
        publish(
            &js,
            "devicelist.in.resync",
            &json!({"user_id": user}).to_string(),
            None,
        )
        .await;
    }
    // Every job has run at least twice (retry_min is 200 ms in tests).
    common::eventually(Duration::from_secs(20), "evil jobs retried", || async {
        let stream = js.get_stream("DEVICE_LIST_FETCH").await.ok()?;
        let mut consumer: async_nats::jetstream::consumer::PullConsumer = stream
            .get_consumer("device-list-updater-fetch")
            .await
            .ok()?;
        let info = consumer.info().await.ok()?;
        (info.num_redelivered >= 2).then_some(())
    })
    .await;
    assert_eq!(fleet.requests(good), 1);
    assert_eq!(hits.load(Ordering::SeqCst), 0, "the trap was contacted");
    for user in &evil {
        let mark = stale_user::Entity::find_by_id(user.clone())
            .one(worker.store.connection())
            .await
            .unwrap();
        assert!(mark.is_some(), "{user} stays stale");
    }
}
both_backends!(worker_guard, worker_never_contacts_loopback);
