//! The command line: exit code 2 with one clear line for bad configuration,
//! `generate-key` and `migrate`.

mod common;

use std::process::Output;
use std::time::Duration;

use device_list_updater::server_key::ServerKey;
use tokio::process::Command;

async fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(common::binary());
    command.args(args);
    for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("DLU_")) {
        command.env_remove(key);
    }
    for (key, value) in env {
        command.env(key, value);
    }
    tokio::time::timeout(Duration::from_secs(60), command.output())
        .await
        .expect("finishes")
        .expect("runs")
}

#[tokio::test]
async fn bad_configuration_exits_2_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("signing.key");
    let key = key.to_str().unwrap();
    let out = run(&["run"], &[]).await;
    common::one_line_error(&out, &["server_name is required"]);
    let out = run(&["run"], &[("DLU_SERVER_NAME", "our.example")]).await;
    common::one_line_error(&out, &["signing_key_path is required"]);
    let out = run(
        &["run"],
        &[
            ("DLU_SERVER_NAME", "our.example"),
            ("DLU_SIGNING_KEY_PATH", key),
        ],
    )
    .await;
    common::one_line_error(&out, &["signing key"]);
    ServerKey::generate()
        .unwrap()
        .write_new(std::path::Path::new(key))
        .unwrap();
    let out = run(
        &["run"],
        &[
            ("DLU_SERVER_NAME", "our.example"),
            ("DLU_SIGNING_KEY_PATH", key),
            ("DLU_RETRY_MIN", "soon"),
        ],
    )
    .await;
    common::one_line_error(&out, &["retry_min"]);
    // a flag overrides the environment
    let out = run(
        &["run", "--server-name", "bad name!"],
        &[
            ("DLU_SERVER_NAME", "our.example"),
            ("DLU_SIGNING_KEY_PATH", key),
        ],
    )
    .await;
    common::one_line_error(&out, &["server_name"]);
}

#[tokio::test]
async fn unreachable_nats_exits_2_after_a_bounded_wait() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("signing.key");
    ServerKey::generate().unwrap().write_new(&key).unwrap();
    // a port nobody listens on
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nats = format!("nats://127.0.0.1:{port}");
    let db = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("db.sqlite").display()
    );
    let out = run(
        &["run"],
        &[
            ("DLU_SERVER_NAME", "our.example"),
            ("DLU_SIGNING_KEY_PATH", key.to_str().unwrap()),
            ("DLU_NATS_URL", &nats),
            ("DLU_DATABASE_URL", &db),
            ("DLU_STARTUP_TIMEOUT", "1s"),
        ],
    )
    .await;
    common::one_line_error(&out, &["NATS"]);
}

/// NATS refusing our credentials is final: exit 2 at once (not after the
/// start-up wait), in one line that says so and does not show the secret.
#[tokio::test]
async fn wrong_nats_credential_exits_2_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("signing.key");
    ServerKey::generate().unwrap().write_new(&key).unwrap();
    let nats = device_list_updater::testkit::Nats::start_with_config(
        "authorization { user: dlu, password: right-Passw0rd }",
    )
    .await;
    let db = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("db.sqlite").display()
    );
    let wrong = "wr0ng-Passw0rd";
    let url = nats
        .url
        .replacen("nats://", &format!("nats://dlu:{wrong}@"), 1);
    let started = std::time::Instant::now();
    let out = run(
        &["run"],
        &[
            ("DLU_SERVER_NAME", "our.example"),
            ("DLU_SIGNING_KEY_PATH", key.to_str().unwrap()),
            ("DLU_NATS_URL", &url),
            ("DLU_DATABASE_URL", &db),
            ("DLU_STARTUP_TIMEOUT", "120s"),
        ],
    )
    .await;
    common::one_line_error(&out, &["authorization violation"]);
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "gave up at once, not after the start-up wait"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains(wrong), "the password is shown: {stderr}");
    // A file credential that cannot be read is named, also in one line.
    let out = run(
        &["run"],
        &[
            ("DLU_SERVER_NAME", "our.example"),
            ("DLU_SIGNING_KEY_PATH", key.to_str().unwrap()),
            ("DLU_NATS_URL", &nats.url),
            ("DLU_NATS_NKEY_SEED", "/nonexistent/user.nk"),
            ("DLU_DATABASE_URL", &db),
        ],
    )
    .await;
    common::one_line_error(&out, &["/nonexistent/user.nk"]);
}

#[tokio::test]
async fn generate_key_writes_a_loadable_key_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("signing.key");
    let out = run(&["generate-key", path.to_str().unwrap()], &[]).await;
    assert!(out.status.success());
    let printed = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let key = ServerKey::load(&path).unwrap();
    assert_eq!(printed, key.key_id());
    let again = run(&["generate-key", path.to_str().unwrap()], &[]).await;
    assert!(!again.status.success(), "never overwrites a key");
    assert_eq!(ServerKey::load(&path).unwrap(), key);
}

#[tokio::test]
async fn migrate_creates_the_schema() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("db.sqlite").display()
    );
    let out = run(&["migrate"], &[("DLU_DATABASE_URL", &db)]).await;
    assert!(out.status.success(), "{out:?}");
    let store = device_list_updater::store::Store::connect(&db)
        .await
        .unwrap();
    assert_eq!(
        store.outbox_len().await.unwrap(),
        0,
        "the outbox table exists"
    );
}

#[tokio::test]
async fn logs_can_be_json() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("db.sqlite").display()
    );
    let out = run(
        &["migrate"],
        &[("DLU_DATABASE_URL", &db), ("DLU_LOG_FORMAT", "json")],
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr
        .lines()
        .find(|l| l.contains("migrations applied"))
        .expect("the migrate log line");
    let json: serde_json::Value = serde_json::from_str(line).expect("a JSON log line");
    assert_eq!(json["level"], "INFO");
    assert_eq!(json["fields"]["message"], "migrations applied");

    let out = run(
        &["migrate"],
        &[("DLU_DATABASE_URL", &db), ("DLU_LOG_FORMAT", "xml")],
    )
    .await;
    common::one_line_error(&out, &["DLU_LOG_FORMAT"]);
}
