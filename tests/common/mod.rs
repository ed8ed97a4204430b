//! Test harness: a real nats-server per test, a fresh SQLite file or
//! PostgreSQL database per test, worker configurations, and helpers that wait
//! on conditions (never on fixed sleeps).

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use async_nats::jetstream;
use device_list_updater::config::Config;

pub mod burst;
pub mod certs;
pub mod fetch_env;
pub mod proxy;
pub mod rooms;

/// Our homeserver in tests.
pub const OUR_SERVER: &str = "our.example";

#[allow(unused_imports)] // each test crate uses a different subset
pub use device_list_updater::testkit::Nats;

/// Which database a test runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// A SQLite file in a temporary directory.
    Sqlite,
    /// A fresh PostgreSQL database (`DLU_TEST_PG_URL`, default local trust auth).
    Postgres,
}

/// A test database, removed when dropped.
pub struct TestDb {
    /// Its URL.
    pub url: String,
    _dir: Option<tempfile::TempDir>,
    pg_name: Option<String>,
}

/// The PostgreSQL URL tests create their databases with.
pub fn pg_admin_url() -> String {
    std::env::var("DLU_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

impl TestDb {
    /// Creates an empty database.
    pub async fn new(backend: Backend) -> TestDb {
        match backend {
            Backend::Sqlite => {
                let dir = tempfile::tempdir().expect("temp dir");
                let url = format!(
                    "sqlite://{}?mode=rwc",
                    dir.path().join("dlu.sqlite").display()
                );
                TestDb {
                    url,
                    _dir: Some(dir),
                    pg_name: None,
                }
            }
            Backend::Postgres => {
                let (url, name) = device_list_updater::testkit::create_postgres_database(
                    &pg_admin_url(),
                    "dlu_test",
                )
                .await;
                TestDb {
                    url,
                    _dir: None,
                    pg_name: Some(name),
                }
            }
        }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let Some(name) = self.pg_name.take() else {
            return;
        };
        // Dropping needs async I/O; do it on a private runtime in a thread.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(device_list_updater::testkit::drop_postgres_database(
                &pg_admin_url(),
                &name,
            ));
        })
        .join();
    }
}

/// A worker configuration for tests: short timeouts, any free HTTP port.
pub fn config(nats: &Nats, db: &TestDb) -> Config {
    Config::for_tests(OUR_SERVER, &nats.url, &db.url)
}

#[allow(unused_imports)] // each test crate uses a different subset
pub use device_list_updater::testkit::wait_for as eventually;

/// Publishes to JetStream and waits for the stream's ack.
pub async fn publish(js: &jetstream::Context, subject: &str, body: &str, origin: Option<&str>) {
    let mut headers = async_nats::HeaderMap::new();
    if let Some(origin) = origin {
        headers.insert("origin", origin);
    }
    js.publish_with_headers(subject.to_owned(), headers, body.to_owned().into())
        .await
        .expect("publish")
        .await
        .expect("publish ack");
}

/// Publishes `messages` (subject, body) in order, awaiting the stream's
/// acks a thousand at a time (async-nats lends only so many permits to acks
/// nobody awaits).
pub async fn publish_many(js: &jetstream::Context, messages: Vec<(&str, String)>) {
    let mut acks = Vec::with_capacity(1_000);
    for (subject, body) in messages {
        acks.push(
            js.publish(subject.to_owned(), body.into())
                .await
                .expect("publish"),
        );
        if acks.len() == 1_000 {
            for ack in acks.drain(..) {
                ack.await.expect("publish ack");
            }
        }
    }
    for ack in acks {
        ack.await.expect("publish ack");
    }
}

/// Message `seq` of `stream`, or None if it was deleted. Any other error is
/// retried, then fails the test: a read that skipped messages on an error
/// would let checks over the stream pass on nothing.
async fn raw_message(
    stream: &jetstream::stream::Stream,
    seq: u64,
) -> Option<jetstream::message::StreamMessage> {
    use jetstream::stream::RawMessageErrorKind;
    let mut attempts = 0;
    loop {
        match stream.get_raw_message(seq).await {
            Ok(message) => return Some(message),
            Err(err) if err.kind() == RawMessageErrorKind::NoMessageFound => return None,
            Err(err) if attempts < 3 => {
                attempts += 1;
                eprintln!("reading message {seq} again after: {err}");
            }
            Err(err) => panic!("message {seq} of the stream could not be read: {err}"),
        }
    }
}

/// A message read back from a stream.
#[derive(Debug, Clone)]
pub struct Stored {
    /// Its subject.
    pub subject: String,
    /// Its headers as (name, value) pairs.
    pub headers: Vec<(String, String)>,
    /// Its body parsed as JSON (Null if not JSON).
    pub json: serde_json::Value,
    /// Its raw body.
    pub body: Vec<u8>,
}

impl Stored {
    /// One header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

use device_list_updater::testkit::member_key_in;
#[allow(unused_imports)] // each test crate uses a different subset
pub use device_list_updater::testkit::stream_len;

/// Every message of `stream`, in order.
pub async fn read_stream(js: &jetstream::Context, stream: &str) -> Vec<Stored> {
    let mut s = js.get_stream(stream).await.expect("stream");
    let info = s.info().await.expect("info");
    let (first, last) = (info.state.first_sequence, info.state.last_sequence);
    let mut out = Vec::new();
    if info.state.messages == 0 {
        return out;
    }
    for seq in first..=last {
        let Some(message) = raw_message(&s, seq).await else {
            continue;
        };
        let headers: Vec<(String, String)> = message
            .headers
            .iter()
            .flat_map(|(name, values)| {
                values
                    .iter()
                    .map(move |v| (name.to_string(), v.as_str().to_owned()))
            })
            .collect();
        if stream == "KEY_CHANGE" {
            // Across every test: a key change never names a member key
            // (SPEC §5.6).
            let text = String::from_utf8_lossy(&message.payload);
            let key = member_key_in(&text).or_else(|| {
                let mut values = headers.iter().map(|(_, v)| v.as_str());
                values.find_map(member_key_in)
            });
            assert!(key.is_none(), "a key change names member key {key:?}");
        }
        out.push(Stored {
            subject: message.subject.to_string(),
            headers,
            json: serde_json::from_slice(&message.payload).unwrap_or(serde_json::Value::Null),
            body: message.payload.to_vec(),
        });
    }
    out
}

/// Panics if a reply names a member key: across every test, no RPC reply
/// does (SPEC §5.6).
#[allow(dead_code)] // each test crate uses a different subset
pub fn assert_names_no_member_key(reply: &[u8]) {
    let text = String::from_utf8_lossy(reply);
    let key = member_key_in(&text);
    assert!(key.is_none(), "a reply names member key {key:?}: {text}");
}

/// Waits until `stream` holds exactly `n` messages, then returns them.
pub async fn wait_stream(js: &jetstream::Context, stream: &str, n: u64) -> Vec<Stored> {
    eventually(
        Duration::from_secs(20),
        &format!("{n} messages in {stream}"),
        || async { (stream_len(js, stream).await >= n).then_some(()) },
    )
    .await;
    let messages = read_stream(js, stream).await;
    assert_eq!(
        messages.len() as u64,
        n,
        "{stream} holds more than {n} messages: {messages:#?}"
    );
    messages
}

#[allow(unused_imports)] // each test crate uses a different subset
pub use device_list_updater::testkit::wait_input_drained;

#[allow(unused_imports)] // each test crate uses a different subset
pub use device_list_updater::testkit::create_input_stream;

/// `GET path` over plain HTTP/1.1; returns the status code.
pub async fn http_status(addr: std::net::SocketAddr, path: &str) -> u16 {
    http_get(addr, path).await.0
}

/// `GET path` over plain HTTP/1.1; returns the status code and the body.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("status line");
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The value of the sample `name` (with its labels, as exported) in a
/// Prometheus text exposition.
pub fn metric_sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The binary exited 2 with one `device-list-updater:` line on stderr,
/// holding every one of `needles`.
pub fn one_line_error(output: &std::process::Output, needles: &[&str]) {
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("device-list-updater:"))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    for needle in needles {
        assert!(lines[0].contains(needle), "{needle:?} not in {stderr}");
    }
}

/// The binary under test.
pub fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_device-list-updater"))
}

/// Defines `<name>_sqlite` and `<name>_postgres` tests running `body(Backend)`.
#[macro_export]
macro_rules! both_backends {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                ($body)(common::Backend::Sqlite).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                ($body)(common::Backend::Postgres).await;
            }
        }
    };
}

/// A worker process for `nats` and `db`, signing with the key file at
/// `key_path`, output discarded; callers add settings and spawn it.
pub fn worker_command(
    nats: &Nats,
    db: &TestDb,
    key_path: &std::path::Path,
) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(binary());
    command
        .arg("run")
        .env("DLU_SERVER_NAME", OUR_SERVER)
        .env("DLU_SIGNING_KEY_PATH", key_path)
        .env("DLU_DATABASE_URL", &db.url)
        .env("DLU_NATS_URL", &nats.url)
        .env("DLU_HTTP_ADDR", "127.0.0.1:0")
        .env("RUST_LOG", "warn")
        .env_remove("DLU_FAULT")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    command
}

/// Writes one key-change event straight into the outbox, as a batch that
/// committed but was not published (its publisher died, or NATS was down)
/// leaves it. Returns the event's payload.
#[allow(dead_code)] // each test crate uses a different subset
pub async fn leave_in_outbox(db: &sea_orm::DatabaseConnection, user: &str) -> serde_json::Value {
    use sea_orm::{ActiveModelTrait as _, ActiveValue::NotSet, ActiveValue::Set};
    let payload = serde_json::json!({"user_id": user, "device_id": "LEFT", "stream_id": 1,
                                     "deleted": false, "left_in_outbox": true});
    let events = serde_json::json!([{"user_id": user, "subject": "key_change.device",
                                     "payload": payload}]);
    entity::key_change_outbox::ActiveModel {
        id: NotSet,
        events: Set(events.to_string()),
        event_count: Set(1),
        created_at_ms: Set(0),
    }
    .insert(db)
    .await
    .expect("outbox row");
    payload
}

/// Stores `user` as known up to stream id 0, as after a fetch: its next
/// update (stream id 1, `prev_id` [0]) applies and emits a key change.
#[allow(dead_code)] // each test crate uses a different subset
pub async fn known_user(db: &sea_orm::DatabaseConnection, user: &str) {
    use sea_orm::{ActiveModelTrait as _, ActiveValue::Set};
    let server = user.split_once(':').map(|(_, s)| s).unwrap_or_default();
    entity::remote_user::ActiveModel {
        user_id: Set(user.to_owned()),
        server_name: Set(server.to_owned()),
        known_stream_ids: Set("[0]".into()),
        max_stream_id: Set(0),
        fetched_stream_id: Set(0),
        fetched_at_ms: Set(0),
    }
    .insert(db)
    .await
    .expect("a known user");
}

/// Runs `statement` on the store's database; panics with it if it fails
/// (for tests that set up rows the store's own API has no call for).
pub async fn sql(store: &device_list_updater::store::Store, statement: &str) {
    use sea_orm::ConnectionTrait as _;
    store
        .connection()
        .execute_unprepared(statement)
        .await
        .unwrap_or_else(|e| panic!("{statement}: {e}"));
}

/// Stores `user` of `server` known up to stream id 1, its list last
/// fetched at `fetched_at_ms` (0: never, so due for revalidation).
pub async fn stored_user(
    store: &device_list_updater::store::Store,
    user: &str,
    server: &str,
    fetched_at_ms: i64,
) {
    sql(
        store,
        &format!(
            "INSERT INTO remote_user (user_id, server_name, known_stream_ids, max_stream_id, fetched_stream_id, fetched_at_ms) \
             VALUES ('{user}', '{server}', '[1]', 1, 1, {fetched_at_ms})"
        ),
    )
    .await;
}
