//! Secured PostgreSQL (SPEC §3: `sslmode` and `sslrootcert` in
//! `DLU_DATABASE_URL`), against a private PostgreSQL instance that takes TCP
//! connections over TLS only: `verify-full` with the CA file carries the
//! whole update → key change path, `require` connects without checking the
//! certificate, no `sslmode` means no TLS, and a certificate that does not verify or a connection
//! without TLS ends the start-up at once with one line (exit 2).

mod common;

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use common::certs::certificates;
use common::{Nats, OUR_SERVER};
use device_list_updater::config::Config;
use device_list_updater::server_key::ServerKey;
use device_list_updater::testkit::postgres::PrivatePostgres;
use device_list_updater::worker;
use sea_orm::{ConnectionTrait as _, Statement};
use serde_json::json;

const ALICE: &str = "@alice:remote.example";

/// Test certificates in a fresh directory (kept while the value lives) and
/// an instance serving the server certificate from them.
fn tls_instance() -> (tempfile::TempDir, PrivatePostgres) {
    let certs = tempfile::tempdir().unwrap();
    certificates(certs.path());
    let pg = PrivatePostgres::start_with_tls(
        &certs.path().join("server.pem"),
        &certs.path().join("server.key"),
    );
    (certs, pg)
}

/// `pg`'s URL with `query` (the TLS parameters) after it.
fn with_query(pg: &PrivatePostgres, query: &str) -> String {
    format!("{}?{query}", pg.url)
}

/// Whether the store's own connection is encrypted, by the server's word.
async fn over_tls(db: &sea_orm::DatabaseConnection) -> bool {
    let row = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        ))
        .await
        .expect("pg_stat_ssl")
        .expect("a row for our connection");
    row.try_get::<bool>("", "ssl").expect("the ssl column")
}

#[tokio::test]
async fn verify_full_with_the_ca_file() {
    let (certs, pg) = tls_instance();
    let ca = certs.path().join("ca.pem");
    let url = with_query(
        &pg,
        &format!("sslmode=verify-full&sslrootcert={}", ca.display()),
    );
    let nats = Nats::start().await;
    let js = nats.js().await;
    let running = worker::start(Config::for_tests(OUR_SERVER, &nats.url, &url))
        .await
        .expect("the worker starts over TLS");
    let db = running.store.connection();
    assert!(over_tls(db).await, "the connection is encrypted");
    common::known_user(db, ALICE).await;
    let update = json!({"user_id": ALICE, "device_id": "PHONE", "stream_id": 1, "prev_id": [0],
                        "device_display_name": "Phone", "keys": {"n": 1}});
    common::publish(&js, "devicelist.in.update", &update.to_string(), None).await;
    let changes = common::wait_stream(&js, "KEY_CHANGE", 1).await;
    assert_eq!(changes[0].json["user_id"], ALICE);
    assert_eq!(changes[0].json["device_id"], "PHONE");
    running.stop(Duration::from_secs(10)).await;
}

#[tokio::test]
async fn require_encrypts_without_a_ca_file() {
    let (_certs, pg) = tls_instance();
    let store = worker::open_store(&with_query(&pg, "sslmode=require"), Duration::from_secs(10))
        .await
        .expect("connects and migrates over TLS");
    assert!(over_tls(store.connection()).await);
}

/// Without `sslmode` the connection is not encrypted, even where the server
/// offers TLS (libpq's default would be `prefer`; see `Store::connect`):
/// this instance takes TCP connections only over TLS, so it refuses us.
#[tokio::test]
async fn no_sslmode_means_no_tls() {
    let (_certs, pg) = tls_instance();
    let error = device_list_updater::store::Store::connect(&pg.url)
        .await
        .expect_err("no TLS attempted, so no pg_hba.conf line matches");
    assert!(error.to_string().contains("pg_hba.conf"), "{error}");
}

/// `device-list-updater run` against `database_url` (NATS is up); its output.
async fn run_with_database(nats: &Nats, key: &Path, database_url: &str) -> Output {
    let mut command = tokio::process::Command::new(common::binary());
    command
        .arg("run")
        .env("DLU_SERVER_NAME", OUR_SERVER)
        .env("DLU_SIGNING_KEY_PATH", key)
        .env("DLU_NATS_URL", &nats.url)
        .env("DLU_DATABASE_URL", database_url)
        .env("DLU_HTTP_ADDR", "127.0.0.1:0")
        .env("DLU_STARTUP_TIMEOUT", "120s")
        .env_remove("DLU_FAULT")
        .kill_on_drop(true);
    tokio::time::timeout(Duration::from_secs(90), command.output())
        .await
        .expect("gives up before the start-up wait is over")
        .expect("runs")
}

/// Refusals that waiting cannot mend end the start-up at once, not after
/// `DLU_STARTUP_TIMEOUT` (120 s here).
#[tokio::test]
async fn refused_tls_exits_2_at_once() {
    let (_certs, pg) = tls_instance();
    let other = tempfile::tempdir().unwrap();
    certificates(other.path());
    let nats = Nats::start().await;
    let key = other.path().join("signing.key");
    ServerKey::generate().unwrap().write_new(&key).unwrap();

    // A CA that did not sign the server's certificate.
    let wrong_ca = with_query(
        &pg,
        &format!(
            "sslmode=verify-full&sslrootcert={}",
            other.path().join("ca.pem").display()
        ),
    );
    let started = Instant::now();
    let out = run_with_database(&nats, &key, &wrong_ca).await;
    common::one_line_error(&out, &["cannot connect to the database", "certificate"]);
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "gave up at once, not after the start-up wait"
    );

    // Without TLS the server has no `pg_hba.conf` line for us.
    let started = Instant::now();
    let out = run_with_database(&nats, &key, &with_query(&pg, "sslmode=disable")).await;
    common::one_line_error(&out, &["cannot connect to the database", "pg_hba.conf"]);
    assert!(started.elapsed() < Duration::from_secs(60));
}
