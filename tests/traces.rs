//! Traces over OTLP/HTTP: with `OTEL_EXPORTER_OTLP_ENDPOINT` set, the worker
//! exports a span per batch, per fetch job and per federation request, with
//! the user and server on them.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Nats, TestDb, publish};
use device_list_updater::testkit::remote::{KeyedFleet, Reply, device_list};
use serde_json::{Value, json};

const ALICE: &str = "@alice:remote.example";

/// Every span (name → attributes) found in the collected OTLP/JSON bodies.
fn spans(bodies: &[Value]) -> Vec<(String, Vec<(String, String)>)> {
    fn walk(value: &Value, out: &mut Vec<(String, Vec<(String, String)>)>) {
        match value {
            Value::Object(map) => {
                if let (Some(Value::String(name)), Some(Value::String(_))) =
                    (map.get("name"), map.get("spanId"))
                {
                    let attributes = map
                        .get("attributes")
                        .and_then(Value::as_array)
                        .map(|list| {
                            list.iter()
                                .filter_map(|a| {
                                    let key = a["key"].as_str()?.to_owned();
                                    let value =
                                        a["value"].as_object()?.values().next().map(|v| {
                                            v.as_str()
                                                .map(str::to_owned)
                                                .unwrap_or_else(|| v.to_string())
                                        })?;
                                    Some((key, value))
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    out.push((name.clone(), attributes));
                }
                map.values().for_each(|v| walk(v, out));
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    bodies.iter().for_each(|b| walk(b, &mut out));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_over_otlp() {
    // The collector: keeps every JSON body posted to /v1/traces.
    let bodies: Arc<Mutex<Vec<Value>>> = Arc::default();
    let kept = bodies.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let kept = kept.clone();
            async move {
                if let Ok(json) = serde_json::from_slice::<Value>(&body) {
                    kept.lock().unwrap().push(json);
                }
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let collector = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let nats = Nats::start().await;
    let db = TestDb::new(common::Backend::Sqlite).await;
    let keyed = KeyedFleet::start(common::OUR_SERVER, Duration::ZERO).await;
    let fleet = &keyed.fleet;
    fleet.script(
        ALICE,
        vec![Reply::Json(device_list(ALICE, 1, &[("D", "P")]))],
    );
    let mut child = common::worker_command(&nats, &db, &keyed.key_path)
        .env(
            "DLU_FEDERATION_OVERRIDES",
            format!("remote.example={}", fleet.base_url()),
        )
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{collector}"))
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("RUST_LOG", "info")
        .spawn()
        .expect("spawn worker");
    let js = nats.js().await;
    common::eventually(Duration::from_secs(20), "input stream", || async {
        js.get_stream("DEVICE_LIST_INPUT").await.ok().map(|_| ())
    })
    .await;
    publish(
        &js,
        "devicelist.in.resync",
        &json!({"user_id": ALICE}).to_string(),
        None,
    )
    .await;
    common::eventually(
        Duration::from_secs(20),
        "federation_request span exported",
        || async {
            let found = spans(&bodies.lock().unwrap());
            let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
            (names.contains(&"federation_request")
                && names.contains(&"batch")
                && names.contains(&"fetch_job"))
            .then_some(found)
        },
    )
    .await;
    let found = spans(&bodies.lock().unwrap());
    let attribute = |span: &str, key: &str| {
        found
            .iter()
            .filter(|(n, _)| n == span)
            .flat_map(|(_, a)| a.iter())
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(
        attribute("federation_request", "user").as_deref(),
        Some(ALICE)
    );
    assert_eq!(
        attribute("federation_request", "server").as_deref(),
        Some("remote.example")
    );
    assert_eq!(
        attribute("federation_request", "status").as_deref(),
        Some("200")
    );
    assert_eq!(
        attribute("fetch_job", "server").as_deref(),
        Some("remote.example")
    );
    assert_eq!(attribute("batch", "user").as_deref(), Some(ALICE));
    child.start_kill().unwrap();
}
