//! Fetching from a real Synapse (SPEC §5.2, §5.3): users, devices,
//! cross-signing keys, renames, additions and deletions made through
//! Synapse's client-server API, fetched by the worker with real X-Matrix
//! requests that Synapse verifies by fetching our key over HTTPS from a key
//! server the test runs. The stored lists and the key changes are checked
//! against what Synapse holds, with `allow_device_name_lookup_over_federation`
//! on and off. A worker signing with a key Synapse cannot find is refused
//! (401) and fetches nothing, so the test fails when signing is broken.
//!
//! Needs `SYNAPSE_PYTHON`: a Python with `matrix-synapse` installed
//! (`scripts/synapse-python` installs the pinned version; `scripts/test`
//! sets it).

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::{Backend, Nats, TestDb};
use device_list_updater::config::Config;
use device_list_updater::server_key::ServerKey;
use device_list_updater::store::query::UserView;
use device_list_updater::worker::{self, Running};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};

const SYNAPSE_NAME: &str = "remote.test";
const ALICE: &str = "@alice:remote.test";
const BOB: &str = "@bob:remote.test";
const CAROL: &str = "@carol/q+r=s:remote.test";

fn python() -> String {
    std::env::var("SYNAPSE_PYTHON").expect(
        "SYNAPSE_PYTHON must name a Python with matrix-synapse installed \
         (scripts/synapse-python installs it; scripts/test sets it)",
    )
}

fn harness_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/synapse/harness.py")
}

/// A free TCP port on loopback (Synapse needs one named in its config).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A running Synapse and our key server, both stopped when dropped.
struct Synapse {
    dir: tempfile::TempDir,
    port: u16,
    /// Our server name: the key server's address.
    our_name: String,
    _children: Vec<Child>,
}

impl Synapse {
    /// Starts Synapse on a free port. The port is free when picked but not
    /// held until Synapse binds it, so another test may take it first:
    /// Synapse then exits, and it is started again on another port.
    async fn start(names_over_federation: bool, our_key: &Path) -> Synapse {
        for _ in 0..3 {
            if let Some(synapse) = Synapse::try_start(names_over_federation, our_key).await {
                return synapse;
            }
        }
        panic!("Synapse exited before listening three times (its port taken?)");
    }

    /// One attempt: None if Synapse exited before it listened.
    async fn try_start(names_over_federation: bool, our_key: &Path) -> Option<Synapse> {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_port();
        let names = if names_over_federation { "on" } else { "off" };
        harness(dir.path(), &["setup", &port.to_string(), names]).await;
        let mut key_server = Command::new(python())
            .arg(harness_path())
            .arg("keyserver")
            .arg(dir.path())
            .arg(our_key)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("key server starts");
        let mut lines = BufReader::new(key_server.stdout.take().expect("stdout")).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("key server listening in time")
            .expect("key server output")
            .expect("a line");
        let listening: Value = serde_json::from_str(&first).expect("JSON");
        let our_name = listening["server_name"].as_str().expect("name").to_owned();
        let synapse = std::sync::Mutex::new(
            Command::new(python())
                .args(["-m", "synapse.app.homeserver", "-c"])
                .arg(dir.path().join("homeserver.yaml"))
                .current_dir(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .expect("synapse starts"),
        );
        let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let listening =
            common::eventually(Duration::from_secs(60), "synapse listening", || async {
                let exited = synapse
                    .lock()
                    .map(|mut child| matches!(child.try_wait(), Ok(Some(_))))
                    .unwrap_or(false);
                if exited {
                    return Some(false);
                }
                let connected = tokio::net::TcpStream::connect(addr).await.is_ok();
                if !connected {
                    return None;
                }
                // Bounded: whoever took the port may never answer.
                let status = tokio::time::timeout(
                    Duration::from_secs(2),
                    common::http_status(addr, "/_matrix/client/versions"),
                )
                .await;
                (status.ok() == Some(200)).then_some(true)
            })
            .await;
        if !listening {
            let log = std::fs::read_to_string(dir.path().join("synapse.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            eprintln!(
                "Synapse exited before listening on {port}; trying another port. Its log ends:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
            return None;
        }
        let synapse = synapse.into_inner().unwrap_or_else(|e| e.into_inner());
        Some(Synapse {
            dir,
            port,
            our_name,
            _children: vec![key_server, synapse],
        })
    }

    async fn run(&self, command: &str) -> Value {
        harness(self.dir.path(), &[command, &self.port.to_string()]).await
    }

    /// The end of Synapse's log, for failure messages.
    fn log(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("synapse.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// How often Synapse fetched our key.
    fn key_requests(&self) -> usize {
        std::fs::read_to_string(self.dir.path().join("key_requests.log"))
            .map(|log| log.lines().count())
            .unwrap_or(0)
    }
}

/// Runs a harness command; its stdout is one JSON object.
async fn harness(dir: &Path, args: &[&str]) -> Value {
    let output = Command::new(python())
        .arg(harness_path())
        .arg(args[0])
        .arg(dir)
        .args(&args[1..])
        .output()
        .await
        .expect("harness runs");
    assert!(
        output.status.success(),
        "harness {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("harness prints JSON")
}

/// A worker named `our_name` that signs with `key` and reaches Synapse
/// directly.
fn config(nats: &Nats, db: &TestDb, synapse: &Synapse, key: ServerKey) -> Config {
    let mut config = common::config(nats, db);
    config.server_name = synapse.our_name.as_str().try_into().expect("server name");
    config.server_key = key;
    config.settings.federation_overrides = [(
        SYNAPSE_NAME.try_into().expect("name"),
        format!("http://127.0.0.1:{}", synapse.port),
    )]
    .into();
    config
}

/// Asks the worker to resync `user` and waits for its answer (at most
/// `timeout_ms`).
async fn resync(client: &async_nats::Client, user: &str, timeout_ms: u64) -> Value {
    let body = json!({"user_id": user, "timeout_ms": timeout_ms}).to_string();
    let wait = Duration::from_millis(timeout_ms) + Duration::from_secs(5);
    // The worker's subscription may not have reached the server yet.
    let reply = common::eventually(Duration::from_secs(10), "a resync responder", || {
        let request = async_nats::Request::new()
            .payload(body.clone().into())
            .timeout(Some(wait));
        async move {
            match client.send_request("devicelist.rpc.resync", request).await {
                Ok(reply) => Some(reply),
                Err(e) if e.kind() == async_nats::client::RequestErrorKind::NoResponders => None,
                Err(e) => panic!("resync request: {e}"),
            }
        }
    })
    .await;
    common::assert_names_no_member_key(&reply.payload);
    serde_json::from_slice(&reply.payload).expect("JSON reply")
}

/// The stored view of each user equals what Synapse holds: the same
/// devices with the same keys, display names only when Synapse sends them,
/// the same cross-signing keys.
async fn assert_matches(running: &Running, truth: &Value, names_over_federation: bool) {
    let users = [ALICE, BOB, CAROL].map(str::to_owned);
    let stored = running.store.query_users(&users).await.expect("query");
    for user in &users {
        let want = &truth[user.as_str()];
        let have: &UserView = &stored[user];
        assert!(!have.stale, "{user} still stale");
        let want_devices: Vec<&String> = want["devices"]
            .as_object()
            .expect("devices")
            .keys()
            .collect();
        let have_devices: Vec<&String> = have.devices.keys().collect();
        assert_eq!(have_devices, want_devices, "{user}: devices");
        for (device, view) in &have.devices {
            let keys: Value =
                serde_json::from_str(view.keys.as_deref().expect("keys")).expect("JSON");
            assert_eq!(
                keys["keys"], want["devices"][device]["keys"],
                "{user} {device}: keys"
            );
            assert_eq!(keys["user_id"], user.as_str());
            assert_eq!(keys["device_id"], device.as_str());
            let name = want["devices"][device]["display_name"].as_str();
            let expected = if names_over_federation { name } else { None };
            assert_eq!(
                view.display_name.as_deref(),
                expected,
                "{user} {device}: name"
            );
        }
        for (usage, have) in [
            ("master_key", &have.master_key),
            ("self_signing_key", &have.self_signing_key),
        ] {
            let have = have
                .as_deref()
                .map(|json| serde_json::from_str::<Value>(json).expect("JSON")["keys"].clone());
            let want = Some(&want[usage]).filter(|v| !v.is_null()).cloned();
            assert_eq!(have, want, "{user}: {usage}");
        }
    }
}

async fn synapse_lists(backend: Backend, names_over_federation: bool) {
    let key_dir = tempfile::tempdir().expect("temp dir");
    let key_path = key_dir.path().join("our.key");
    let key = ServerKey::generate().expect("key");
    key.write_new(&key_path).expect("key written");
    let synapse = Synapse::start(names_over_federation, &key_path).await;
    synapse.run("populate").await;
    let nats = Nats::start().await;
    let db = TestDb::new(backend).await;
    let client = nats.client().await;
    let js = nats.js().await;

    // Signed with a key our key server does not serve: Synapse fetches our
    // key, cannot verify, answers 401, and nothing is stored.
    let wrong = ServerKey::generate().expect("key");
    let running = worker::start(config(&nats, &db, &synapse, wrong))
        .await
        .expect("worker starts");
    let refused = resync(&client, ALICE, 1_000).await;
    assert_eq!(refused["synced"], false, "{refused}");
    let alice: &ruma::UserId = ALICE.try_into().expect("user id");
    let error = common::eventually(Duration::from_secs(30), "the refusal recorded", || async {
        running.store.stale_state(alice).await.ok()??.1
    })
    .await;
    assert!(
        error.contains("401"),
        "{error}; synapse log:\n{}",
        synapse.log()
    );
    assert!(synapse.key_requests() >= 1, "Synapse never fetched our key");
    running.stop(Duration::from_secs(10)).await;

    // Signed right: every user fetched, as Synapse holds them.
    let running = worker::start(config(&nats, &db, &synapse, key))
        .await
        .expect("worker starts");
    for user in [ALICE, BOB, CAROL] {
        let reply = resync(&client, user, 20_000).await;
        assert_eq!(reply["synced"], true, "{user}: {reply}");
    }
    let truth = synapse.run("truth").await;
    assert_matches(&running, &truth, names_over_federation).await;
    // alice: two devices and her cross-signing keys; bob: one device (the
    // key-less ones are never listed); carol: one device.
    let first = common::wait_stream(&js, "KEY_CHANGE", 5).await;
    assert_eq!(
        first
            .iter()
            .filter(|e| e.subject == "key_change.cross_signing")
            .count(),
        1
    );

    // A rename, a new device and a deletion, fetched again.
    synapse.run("change").await;
    let reply = resync(&client, ALICE, 20_000).await;
    assert_eq!(reply["synced"], true, "{reply}");
    let truth = synapse.run("truth").await;
    assert_matches(&running, &truth, names_over_federation).await;
    // The rename is a visible change only when Synapse sends names.
    let changes = if names_over_federation { 3 } else { 2 };
    common::eventually(Duration::from_secs(10), "outbox published", || async {
        (running.store.outbox_len().await.ok()? == 0).then_some(())
    })
    .await;
    let all = common::wait_stream(&js, "KEY_CHANGE", 5 + changes).await;
    let later: Vec<&Value> = all[5..].iter().map(|e| &e.json).collect();
    let of = |device: &str| later.iter().find(|e| e["device_id"] == device).copied();
    assert_eq!(
        of("ALICELAPTOP").expect("deletion")["deleted"],
        true,
        "{later:?}"
    );
    let tablet = of("ALICETABLET").expect("addition");
    assert_eq!(tablet["deleted"], false, "{later:?}");
    assert_eq!(
        tablet["keys"]["keys"], truth[ALICE]["devices"]["ALICETABLET"]["keys"],
        "{later:?}"
    );
    match of("ALICEPHONE") {
        Some(rename) => {
            assert!(
                names_over_federation,
                "a rename Synapse does not send: {later:?}"
            );
            assert_eq!(rename["display_name"], "Alice's new phone");
        }
        None => assert!(!names_over_federation, "no rename event: {later:?}"),
    }
    running.stop(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_over_federation_sqlite() {
    synapse_lists(Backend::Sqlite, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_names_over_federation_postgres() {
    synapse_lists(Backend::Postgres, false).await;
}
