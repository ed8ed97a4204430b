//! Secured NATS (SPEC §3): TLS with a CA file and a client certificate, and
//! authentication by user and password, token, NKey seed or `.creds` file
//! (decentralised JWT auth, operator mode), against real
//! nats-servers configured for them. The worker runs with an account whose
//! permissions allow only what `docs/operations.md` lists, and no secret
//! shows in its log or on `/metrics`.
//!
//! SQLite only: how the worker reaches NATS does not depend on the database.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::certs::certificates;
use common::{Backend, TestDb};
use device_list_updater::server_key::ServerKey;
use device_list_updater::testkit::Nats;
use device_list_updater::worker;
use serde_json::json;

const ALICE: &str = "@alice:remote.example";
const BOB: &str = "@bob:elsewhere.example";
const WORKER_PASSWORD: &str = "w0rker-Pa55word";

/// The permissions `docs/operations.md` gives the worker's NATS user.
const WORKER_PERMISSIONS: &str = r#"{
    publish: { allow: ["$JS.API.>", "$JS.ACK.>", "$KV.device_list_updater_leases.>",
                       "key_change.>", "devicelist.dead.>", "devicelist.fetch.>"] },
    subscribe: { allow: ["_INBOX.>", "devicelist.rpc.>"] },
    allow_responses: true
}"#;

/// A nats-server with TLS (certificates made in its directory), a
/// `homeserver` user who may do anything and a `worker` user with
/// [`WORKER_PERMISSIONS`]. `verify`: clients must show a certificate too.
async fn secured_server(verify: bool) -> Nats {
    let certs = tempfile::tempdir().unwrap().keep();
    certificates(&certs);
    let conf = format!(
        r#"
        tls {{
            cert_file: "{dir}/server.pem"
            key_file: "{dir}/server.key"
            ca_file: "{dir}/ca.pem"
            verify: {verify}
        }}
        authorization {{
            users = [
                {{ user: homeserver, password: homeserver-pw }}
                {{ user: worker, password: "{WORKER_PASSWORD}", permissions: {WORKER_PERMISSIONS} }}
            ]
        }}
        "#,
        dir = certs.display(),
    );
    let nats = Nats::start_with_config(&conf).await;
    for file in ["ca.pem", "client.pem", "client.key"] {
        std::fs::copy(certs.join(file), nats.dir().join(file)).unwrap();
    }
    let _ = std::fs::remove_dir_all(&certs);
    nats
}

/// A client of `nats` as the homeserver (full permissions, over TLS with a
/// client certificate).
async fn homeserver(nats: &Nats) -> async_nats::Client {
    async_nats::ConnectOptions::new()
        .user_and_password("homeserver".into(), "homeserver-pw".into())
        .add_root_certificates(nats.dir().join("ca.pem"))
        .add_client_certificate(nats.dir().join("client.pem"), nats.dir().join("client.key"))
        .require_tls(true)
        .connect(&nats.url)
        .await
        .expect("the homeserver connects")
}

/// The URL of `nats` with `user:password@` in it.
fn with_credentials(nats: &Nats, credentials: &str) -> String {
    nats.url
        .replacen("nats://", &format!("nats://{credentials}@"), 1)
}

/// The address the worker's HTTP server listens on, from its log's start
/// line (it binds a port of its own choosing: one chosen for it could be
/// taken by another test before it binds).
async fn http_addr_in(log: &std::path::Path) -> std::net::SocketAddr {
    common::eventually(
        Duration::from_secs(30),
        "the worker's start line",
        || async {
            let text = std::fs::read_to_string(log).ok()?;
            let line = text.lines().find(|l| l.contains("worker started"))?;
            let (_, rest) = line.split_once("http_addr=")?;
            rest.split_whitespace().next()?.parse().ok()
        },
    )
    .await
}

/// The worker does its whole job through the restricted account over TLS:
/// input to a key change, a fetch job, an RPC answer. Its log (at debug)
/// and `/metrics` never show the password.
async fn restricted_worker_over_tls(verify: bool) {
    let nats = secured_server(verify).await;
    let db = TestDb::new(Backend::Sqlite).await;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("signing.key");
    ServerKey::generate().unwrap().write_new(&key).unwrap();
    let log = dir.path().join("worker.log");
    // Alice is known up to stream id 0, as after a fetch.
    let store = worker::open_store(&db.url, Duration::from_secs(10))
        .await
        .unwrap();
    common::known_user(store.connection(), ALICE).await;
    let mut command = common::worker_command(&nats, &db, &key);
    command
        .env(
            "DLU_NATS_URL",
            with_credentials(&nats, &format!("worker:{WORKER_PASSWORD}")),
        )
        .env("DLU_NATS_TLS_CA", nats.dir().join("ca.pem"))
        .env("RUST_LOG", "debug")
        .stderr(std::fs::File::create(&log).unwrap());
    if verify {
        command
            .env("DLU_NATS_TLS_CERT", nats.dir().join("client.pem"))
            .env("DLU_NATS_TLS_KEY", nats.dir().join("client.key"));
    }
    let mut child = command.spawn().expect("spawn worker");
    let client = homeserver(&nats).await;
    let js = async_nats::jetstream::new(client.clone());
    common::eventually(
        Duration::from_secs(30),
        "the worker's input stream",
        || async { js.get_stream("DEVICE_LIST_INPUT").await.ok().map(|_| ()) },
    )
    .await;
    // Alice's next update: applied, a key change.
    let update = json!({"user_id": ALICE, "device_id": "PHONE", "stream_id": 1, "prev_id": [0],
        "keys": {"user_id": ALICE, "device_id": "PHONE", "algorithms": [],
                 "keys": {"ed25519:PHONE": "key"}, "signatures": {}}});
    common::publish(&js, "devicelist.in.update", &update.to_string(), None).await;
    let changes = common::wait_stream(&js, "KEY_CHANGE", 1).await;
    assert_eq!(changes[0].header("user_id"), Some(ALICE));
    // A resync: a fetch job for Bob's server.
    common::publish(
        &js,
        "devicelist.in.resync",
        &json!({"user_id": BOB}).to_string(),
        None,
    )
    .await;
    common::eventually(Duration::from_secs(30), "a fetch job", || async {
        let mut stream = js.get_stream("DEVICE_LIST_FETCH").await.ok()?;
        let info = stream.info().await.ok()?;
        (info.state.last_sequence >= 1).then_some(())
    })
    .await;
    let answer = tokio::time::timeout(
        Duration::from_secs(10),
        client.request(
            "devicelist.rpc.query",
            json!({"user_ids": [ALICE]}).to_string().into(),
        ),
    )
    .await
    .expect("the query is answered in time")
    .expect("the query is answered");
    let answer: serde_json::Value = serde_json::from_slice(&answer.payload).unwrap();
    assert!(
        answer["users"][ALICE]["devices"]["PHONE"].is_object(),
        "{answer}"
    );
    let metrics = common::http_get(http_addr_in(&log).await, "/metrics")
        .await
        .1;
    assert!(metrics.contains("dlu_key_changes_published_total"));
    child.kill().await.unwrap();
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(
        log.contains("DEBUG") || log.contains("INFO"),
        "the log was captured: {log}"
    );
    for (what, text) in [("log", &log), ("/metrics", &metrics)] {
        assert!(
            !text.contains(WORKER_PASSWORD),
            "the password is in the {what}"
        );
    }
    assert!(
        !log.contains("Permissions Violation") && !log.contains("permissions violation"),
        "the worker needed a subject its permissions do not allow:\n{log}"
    );
}

#[tokio::test]
async fn tls_with_user_and_password() {
    restricted_worker_over_tls(false).await;
}

#[tokio::test]
async fn mutual_tls() {
    restricted_worker_over_tls(true).await;
}

/// Starts a worker in this process with `settings` changed by `set`, and
/// waits until it has created its streams.
async fn worker_starts(nats: &Nats, set: impl FnOnce(&mut device_list_updater::config::Settings)) {
    let db = TestDb::new(Backend::Sqlite).await;
    let mut config = common::config(nats, &db);
    set(&mut config.settings);
    let running = tokio::time::timeout(Duration::from_secs(30), worker::start(config))
        .await
        .expect("starts in time")
        .expect("the worker connects and starts");
    running.stop(Duration::from_secs(10)).await;
}

#[tokio::test]
async fn token_in_the_url() {
    let nats = Nats::start_with_config("authorization { token: \"t0ken-s3cret\" }").await;
    let url = with_credentials(&nats, "t0ken-s3cret");
    worker_starts(&nats, |settings| settings.nats_url = url).await;
}

#[tokio::test]
async fn nkey_seed_file() {
    let user = nkeys::KeyPair::new_user();
    let conf = format!(
        "authorization {{ users = [ {{ nkey: {} }} ] }}",
        user.public_key()
    );
    let nats = Nats::start_with_config(&conf).await;
    let seed: PathBuf = nats.dir().join("user.nk");
    std::fs::write(&seed, format!("{}\n", user.seed().unwrap())).unwrap();
    worker_starts(&nats, |settings| settings.nats_nkey_seed = Some(seed)).await;
}

/// A NATS JWT (`ed25519-nkey`): `claims` with `iss`, `sub` and `iat`
/// added, signed by `issuer`. What `nsc` writes; made here because the
/// machine has no `nsc`.
fn nats_jwt(issuer: &nkeys::KeyPair, subject: &str, mut claims: serde_json::Value) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    claims["iss"] = issuer.public_key().into();
    claims["sub"] = subject.into();
    claims["iat"] = 1_700_000_000.into();
    claims["jti"] = format!("TEST{subject}").into();
    let header = b64.encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let body = b64.encode(claims.to_string());
    let signed = format!("{header}.{body}");
    let signature = issuer.sign(signed.as_bytes()).expect("sign");
    format!("{signed}.{}", b64.encode(signature))
}

/// Decentralised auth: a nats-server in operator mode (its operator JWT, one
/// account preloaded with JetStream), and the worker with a `.creds` file of
/// a user of that account: it starts (creates its streams, consumers and
/// lease bucket through it); without the file it is refused.
#[tokio::test]
async fn creds_file() {
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let operator_jwt = nats_jwt(
        &operator,
        &operator.public_key(),
        json!({"name": "test operator", "nats": {"type": "operator", "version": 2}}),
    );
    let unlimited = json!({"subs": -1, "data": -1, "payload": -1, "imports": -1,
        "exports": -1, "wildcards": true, "conn": -1, "leaf": -1,
        "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1});
    let account_jwt = nats_jwt(
        &operator,
        &account.public_key(),
        json!({"name": "device lists", "nats": {"limits": unlimited, "type": "account", "version": 2}}),
    );
    let user_jwt = nats_jwt(
        &account,
        &user.public_key(),
        json!({"name": "worker", "nats": {"pub": {}, "sub": {}, "subs": -1, "data": -1,
            "payload": -1, "type": "user", "version": 2}}),
    );
    // JetStream needs a system account in operator mode.
    let system = nkeys::KeyPair::new_account();
    let system_jwt = nats_jwt(
        &operator,
        &system.public_key(),
        json!({"name": "SYS", "nats": {"type": "account", "version": 2}}),
    );
    let conf = format!(
        "operator: \"{operator_jwt}\"\nsystem_account: {sys}\nresolver: MEMORY\n\
         resolver_preload: {{ {acc}: \"{account_jwt}\", {sys}: \"{system_jwt}\" }}\n",
        sys = system.public_key(),
        acc = account.public_key()
    );
    let nats = Nats::start_with_config(&conf).await;
    let creds: PathBuf = nats.dir().join("worker.creds");
    std::fs::write(
        &creds,
        format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
             -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
            user.seed().unwrap()
        ),
    )
    .unwrap();
    worker_starts(&nats, |settings| settings.nats_creds = Some(creds.clone())).await;
    // Without the file the server refuses the worker.
    let db = TestDb::new(Backend::Sqlite).await;
    let mut config = common::config(&nats, &db);
    config.settings.startup_timeout = Duration::from_secs(30);
    let refused = tokio::time::timeout(Duration::from_secs(20), worker::start(config))
        .await
        .expect("refused at once, not after the start-up wait");
    assert!(refused.is_err(), "a worker without credentials started");
}
