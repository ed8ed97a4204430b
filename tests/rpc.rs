//! The request-reply subjects (SPEC §4.4) through a real nats-server.

mod common;

use std::time::{Duration, Instant};

use common::{Backend, Nats, TestDb};
use device_list_updater::testkit::remote::{MockFederation, Reply, device_keys, device_list};
use device_list_updater::testkit::wait_for;
use device_list_updater::worker::{self, Running};
use serde_json::{Value, json};

const ALICE: &str = "@alice:remote.example";
const HANGS: &str = "@bob:hangs.example";

struct Env {
    _nats: Nats,
    _db: TestDb,
    client: async_nats::Client,
    _worker: Running,
    fleet: MockFederation,
}

impl Env {
    async fn start(backend: Backend) -> Env {
        let nats = Nats::start().await;
        let db = TestDb::new(backend).await;
        let mut config = common::config(&nats, &db);
        let fleet = MockFederation::trusting(&config, Duration::ZERO).await;
        fleet.serve(&mut config, ["remote.example", "hangs.example"]);
        let worker = worker::start(config).await.unwrap();
        let client = nats.client().await;
        Env {
            _nats: nats,
            _db: db,
            client,
            _worker: worker,
            fleet,
        }
    }

    async fn request(&self, subject: &str, body: Value) -> Value {
        let reply = tokio::time::timeout(
            Duration::from_secs(20),
            self.client
                .request(subject.to_owned(), body.to_string().into()),
        )
        .await
        .expect("a reply in time")
        .expect("request");
        common::assert_names_no_member_key(&reply.payload);
        serde_json::from_slice(&reply.payload).expect("JSON reply")
    }

    /// Waits until `user` is tracked and stale (the mark may be committed
    /// after a timed-out reply) and its server has been asked for it.
    async fn wait_stale_and_asked(&self, user: &str) {
        wait_for(Duration::from_secs(10), "the user stale", || async {
            let query = self
                .request("devicelist.rpc.query", json!({"user_ids": [user]}))
                .await;
            let view = &query["users"][user];
            (view["stale"] == true && view["tracked"] == true).then_some(())
        })
        .await;
        wait_for(
            Duration::from_secs(10),
            "a request for the user",
            || async { (self.fleet.requests(user) >= 1).then_some(()) },
        )
        .await;
    }
}

async fn resync_then_query(backend: Backend) {
    let env = Env::start(backend).await;
    let mut list = device_list(ALICE, 6, &[("JLAFKJWSCS", "Mobile Phone")]);
    list["master_key"] = json!(null);
    env.fleet.script(ALICE, vec![Reply::Json(list)]);
    let reply = env
        .request(
            "devicelist.rpc.resync",
            json!({"user_id": ALICE, "timeout_ms": 10000}),
        )
        .await;
    assert_eq!(reply, json!({"user_id": ALICE, "synced": true}));
    assert_eq!(env.fleet.requests(ALICE), 1);

    let reply = env
        .request(
            "devicelist.rpc.query",
            json!({"user_ids": [ALICE, "@nobody:else.example"]}),
        )
        .await;
    assert_eq!(
        reply["users"][ALICE],
        json!({"tracked": true, "stale": false, "stream_id": 6,
               "devices": {"JLAFKJWSCS": {"display_name": "Mobile Phone",
                                           "keys": device_keys(ALICE, "JLAFKJWSCS")}},
               "master_key": null, "self_signing_key": null})
    );
    assert_eq!(
        reply["users"]["@nobody:else.example"],
        json!({"tracked": false, "stale": false, "stream_id": null, "devices": {},
               "master_key": null, "self_signing_key": null})
    );
}
both_backends!(resync_and_query, resync_then_query);

async fn resync_times_out_on_a_hanging_server(backend: Backend) {
    let env = Env::start(backend).await;
    env.fleet.script(HANGS, vec![Reply::Hang]);
    let started = Instant::now();
    let reply = env
        .request(
            "devicelist.rpc.resync",
            json!({"user_id": HANGS, "timeout_ms": 500}),
        )
        .await;
    let took = started.elapsed();
    assert_eq!(reply["synced"], false);
    assert_eq!(reply["user_id"], HANGS);
    assert!(
        reply["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{reply}"
    );
    assert!(
        took >= Duration::from_millis(500),
        "replied before the timeout: {took:?}"
    );
    env.wait_stale_and_asked(HANGS).await;
}
both_backends!(resync_timeout, resync_times_out_on_a_hanging_server);

/// A timeout shorter than the stale mark's own write: the reply comes at
/// once, and the mark and the fetch happen all the same (SPEC §4.4: the
/// resync marks the user stale and fetches; only the reply is bounded).
async fn resync_marks_stale_even_when_the_reply_times_out_first(backend: Backend) {
    let env = Env::start(backend).await;
    env.fleet.script(HANGS, vec![Reply::Hang]);
    let reply = env
        .request(
            "devicelist.rpc.resync",
            json!({"user_id": HANGS, "timeout_ms": 1}),
        )
        .await;
    assert_eq!(reply["synced"], false, "{reply}");
    env.wait_stale_and_asked(HANGS).await;
}
both_backends!(
    resync_timeout_shorter_than_the_mark,
    resync_marks_stale_even_when_the_reply_times_out_first
);

async fn bad_requests_get_an_error(backend: Backend) {
    let env = Env::start(backend).await;
    let reply = env
        .request("devicelist.rpc.query", json!({"users": []}))
        .await;
    assert!(reply["error"].is_string(), "{reply}");
    let reply = env
        .request("devicelist.rpc.resync", json!({"user_id": "not a user"}))
        .await;
    // Not a user id: refused, not echoed (SPEC §5.6.5).
    assert_eq!(reply, json!({"error": "user_id is not a user id"}));
    let reply = env
        .request(
            "devicelist.rpc.resync",
            json!({"user_id": "@me:our.example"}),
        )
        .await;
    assert_eq!(reply["synced"], false);
}
both_backends!(bad_requests, bad_requests_get_an_error);
