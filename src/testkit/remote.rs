//! A mock fleet of remote homeservers for tests and benchmarks: one HTTP
//! listener that plays any number of servers. Every request must carry a
//! valid X-Matrix signature from our server over the path as sent, and its
//! `destination` must be the server of the user asked for; requests that
//! fail the check get 401 and are counted.
//!
//! The fleet is also the request-loop guard (SPEC §5.2): a fleet made with
//! [`MockFederation::trusting`] fails its test (when dropped) if one user
//! was asked for again within `DLU_RETRY_MIN` of the last time without a
//! reason in between. Tests name reasons with [`MockFederation::reason`]
//! (an update or resync for a user) and [`MockFederation::room_reason`] (a
//! room change, which may start anyone's tracking) before they publish them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use ruma::api::federation::authentication::XMatrix;
use ruma::serde::Base64;
use ruma::signatures::{PublicKeyMap, PublicKeySet};

/// One scripted answer.
#[derive(Clone, Debug)]
pub enum Reply {
    /// 200 with this JSON body.
    Json(serde_json::Value),
    /// This status and JSON body, with an optional `Retry-After` (seconds).
    Status(u16, serde_json::Value, Option<u64>),
    /// 200 with this raw body.
    Raw(Vec<u8>),
    /// Never answers.
    Hang,
    /// Answers as the inner reply once the test releases the gate
    /// (`Notify::notify_one`; a release before the request counts too).
    Held(Arc<tokio::sync::Notify>, Box<Reply>),
}

#[derive(Default)]
struct Fleet {
    /// Answers per user; the last one repeats.
    replies: HashMap<String, VecDeque<Reply>>,
    /// Requests per user that passed the signature check.
    requests: HashMap<String, usize>,
    /// Requests in flight per destination server, and the most ever seen.
    in_flight: HashMap<String, usize>,
    max_in_flight: HashMap<String, usize>,
    /// Requests that failed the X-Matrix check.
    bad_signatures: usize,
    /// When each request per user arrived.
    times: HashMap<String, Vec<std::time::Instant>>,
    /// The raw (percent-encoded) path of every signed request, in order.
    paths: Vec<String>,
    /// Requests that named a member key where a user id belongs.
    named_keys: Vec<String>,
    /// The request-loop guard's window (`DLU_RETRY_MIN`), if on.
    guard: Option<Duration>,
    /// When a reason to ask for each user (or each server's users) again
    /// was last given.
    reasons: HashMap<String, std::time::Instant>,
    /// When a room change (a reason for anyone) was last given.
    room_reason: Option<std::time::Instant>,
    /// Reasons given count however old, until the input they stand for is
    /// applied ([`MockFederation::hold_reasons`]).
    holding_reasons: bool,
    /// Requests the guard refused, described.
    loops: Vec<String>,
}

/// How long before the previous request a reason still counts: input
/// published just before a request was sent may be applied after it
/// (the user stays stale and is asked again). A loop asks again and again
/// for longer than this with no reason at all, and is caught.
const REASON_LAG: Duration = Duration::from_secs(1);

impl Fleet {
    /// Checks a request for `user` arriving `now` against the guard.
    fn guard(&mut self, user: &str, now: std::time::Instant) {
        let Some(window) = self.guard else { return };
        let Some(last) = self.times.get(user).and_then(|t| t.last().copied()) else {
            return;
        };
        let server = user.split_once(':').map_or("", |(_, server)| server);
        let reason = self
            .reasons
            .get(user)
            .copied()
            .max(self.reasons.get(server).copied())
            .max(self.room_reason)
            .is_some_and(|at| self.holding_reasons || at + REASON_LAG >= last);
        let gap = now.duration_since(last);
        if gap < window && !reason {
            self.loops.push(format!(
                "{user} asked for again after {gap:?} (< DLU_RETRY_MIN {window:?}) with no update, resync or room change in between"
            ));
        }
    }
}

/// The fleet's shared state and settings.
#[derive(Clone)]
struct Shared {
    fleet: Arc<Mutex<Fleet>>,
    origin: String,
    keys: PublicKeyMap,
    latency: Duration,
}

/// A running mock fleet.
pub struct MockFederation {
    /// Where it listens: point `DLU_FEDERATION_OVERRIDES` at `http://<addr>`.
    pub addr: SocketAddr,
    shared: Shared,
    _server: tokio::task::JoinHandle<()>,
}

impl MockFederation {
    /// Starts a fleet that accepts requests signed by `origin` with the key
    /// `ed25519:<key_version>` whose public half is `public_key`, and answers
    /// each after `latency`.
    pub async fn start(
        origin: &str,
        key_version: &str,
        public_key: [u8; 32],
        latency: Duration,
    ) -> MockFederation {
        let mut set = PublicKeySet::new();
        set.insert(
            format!("ed25519:{key_version}"),
            Base64::new(public_key.to_vec()),
        );
        let mut keys = PublicKeyMap::new();
        keys.insert(origin.to_owned(), set);
        let shared = Shared {
            fleet: Arc::new(Mutex::new(Fleet::default())),
            origin: origin.to_owned(),
            keys,
            latency,
        };
        let app = axum::Router::new()
            .route(
                "/_matrix/federation/v1/user/devices/{user_id}",
                axum::routing::get(devices),
            )
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind mock federation");
        let addr = listener.local_addr().expect("mock address");
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        MockFederation {
            addr,
            shared,
            _server: server,
        }
    }

    /// A fleet that accepts requests signed as `origin` with `key`.
    pub async fn trusting_key(
        origin: &str,
        key: &crate::server_key::ServerKey,
        latency: Duration,
    ) -> MockFederation {
        let public_key = key.key_pair().expect("usable signing key").public_key();
        MockFederation::start(origin, key.version(), public_key, latency).await
    }

    /// A fleet that accepts requests signed as `config`'s server with its key.
    pub async fn trusting(config: &crate::config::Config, latency: Duration) -> MockFederation {
        let public_key = config
            .server_key
            .key_pair()
            .expect("usable signing key")
            .public_key();
        let fleet = MockFederation::start(
            config.server_name.as_str(),
            config.server_key.version(),
            public_key,
            latency,
        )
        .await;
        fleet.lock().guard = Some(config.settings.retry_min);
        fleet
    }

    /// Sets the request-loop guard's window (`DLU_RETRY_MIN` of the worker
    /// under test; a fleet from [`MockFederation::trusting`] starts with
    /// that of its configuration).
    pub fn guard(&self, window: Duration) {
        self.lock().guard = Some(window);
    }

    /// Gives a reason to ask for `user` again (call before publishing the
    /// update or resync, or sending the RPC, that is the reason). An update
    /// also gives its server's other users one: it ends the server's
    /// back-off (name the server for that).
    pub fn reason(&self, user: &str) {
        let now = std::time::Instant::now();
        self.lock().reasons.insert(user.to_owned(), now);
    }

    /// Gives every user a reason to be asked for again: a room change,
    /// which may start anyone's tracking (call before publishing it).
    pub fn room_reason(&self) {
        self.lock().room_reason = Some(std::time::Instant::now());
    }

    /// While `hold` is true, every reason given counts however old: for
    /// input published at once whose ingestion takes longer than
    /// `REASON_LAG` (a user's update applied seconds after its reason was
    /// given may follow a request for another reason). Released, the
    /// reasons count as if given now, for `REASON_LAG` more; call it once
    /// that input is applied.
    pub fn hold_reasons(&self, hold: bool) {
        let mut fleet = self.lock();
        fleet.holding_reasons = hold;
        if !hold {
            let now = std::time::Instant::now();
            fleet.reasons.values_mut().for_each(|at| *at = now);
            if fleet.room_reason.is_some() {
                fleet.room_reason = Some(now);
            }
        }
    }

    /// The requests the request-loop guard refused so far.
    pub fn loops(&self) -> Vec<String> {
        self.lock().loops.clone()
    }

    /// Points `config`'s federation overrides for `servers` at this fleet.
    pub fn serve<'a>(
        &self,
        config: &mut crate::config::Config,
        servers: impl IntoIterator<Item = &'a str>,
    ) {
        config.settings.federation_overrides = overrides_for(self, servers);
    }

    /// `http://<addr>`, for overrides.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Scripts the answers for `user`, in order; the last one repeats.
    pub fn script(&self, user: &str, replies: Vec<Reply>) {
        self.lock().replies.insert(user.to_owned(), replies.into());
    }

    /// Requests for `user` that passed the signature check.
    pub fn requests(&self, user: &str) -> usize {
        self.lock().requests.get(user).copied().unwrap_or(0)
    }

    /// When each request for `user` arrived.
    pub fn request_times(&self, user: &str) -> Vec<std::time::Instant> {
        self.lock().times.get(user).cloned().unwrap_or_default()
    }

    /// The raw path of every request that passed the signature check, as
    /// it arrived (percent-encoding untouched).
    pub fn raw_paths(&self) -> Vec<String> {
        self.lock().paths.clone()
    }

    /// All requests that passed the signature check.
    pub fn total_requests(&self) -> usize {
        self.lock().requests.values().sum()
    }

    /// The most requests ever in flight at once for `server`.
    pub fn max_in_flight(&self, server: &str) -> usize {
        self.lock().max_in_flight.get(server).copied().unwrap_or(0)
    }

    /// Requests in flight now, all servers together.
    pub fn in_flight_now(&self) -> usize {
        self.lock().in_flight.values().sum()
    }

    /// The most requests ever in flight at once for any one server.
    pub fn max_in_flight_any(&self) -> usize {
        self.lock()
            .max_in_flight
            .values()
            .copied()
            .max()
            .unwrap_or(0)
    }

    /// Requests rejected for a missing or bad X-Matrix signature.
    pub fn bad_signatures(&self) -> usize {
        self.lock().bad_signatures
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Fleet> {
        self.shared
            .fleet
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Every test with a fleet checks on the way out that no request asked for
/// a member key's devices (SPEC §5.6: a key is never a user id).
impl Drop for MockFederation {
    fn drop(&mut self) {
        let named = std::mem::take(&mut self.lock().named_keys);
        let loops = std::mem::take(&mut self.lock().loops);
        if !std::thread::panicking() {
            assert!(named.is_empty(), "requests named member keys: {named:?}");
            assert!(loops.is_empty(), "request loop: {loops:?}");
        }
    }
}

/// Checks the X-Matrix header; returns the destination server.
fn verify(shared: &Shared, method: &Method, uri: &Uri, headers: &HeaderMap) -> Option<String> {
    let x_matrix = XMatrix::extract_from_http_headers(headers).ok()?;
    if x_matrix.origin.as_str() != shared.origin {
        return None;
    }
    let destination = x_matrix.destination.clone()?;
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let request = http::Request::builder()
        .method(method.clone())
        .uri(path)
        .body(Vec::<u8>::new())
        .ok()?;
    x_matrix
        .verify_http_request(&request, &destination, &shared.keys)
        .ok()?;
    Some(destination.to_string())
}

async fn devices(
    State(shared): State<Shared>,
    Path(user_id): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    if let Some(key) = super::member_key_in(&user_id) {
        let mut fleet = shared
            .fleet
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        fleet.named_keys.push(key.to_owned());
    }
    // The destination signed for must be the server of the user asked for.
    let user_server = user_id.split_once(':').map(|(_, server)| server.to_owned());
    let verified = verify(&shared, &method, &uri, &headers)
        .filter(|destination| Some(destination) == user_server.as_ref());
    let Some(destination) = verified else {
        if let Ok(mut fleet) = shared.fleet.lock() {
            fleet.bad_signatures += 1;
        }
        return (StatusCode::UNAUTHORIZED, "bad X-Matrix").into_response();
    };
    let reply = {
        let mut fleet = shared
            .fleet
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *fleet.requests.entry(user_id.clone()).or_default() += 1;
        fleet.paths.push(uri.path().to_owned());
        let now = std::time::Instant::now();
        fleet.guard(&user_id, now);
        fleet.times.entry(user_id.clone()).or_default().push(now);
        let now = {
            let n = fleet.in_flight.entry(destination.clone()).or_default();
            *n += 1;
            *n
        };
        let max = fleet.max_in_flight.entry(destination.clone()).or_default();
        *max = (*max).max(now);
        let queue = fleet.replies.entry(user_id.clone()).or_default();
        if queue.len() > 1 {
            queue.pop_front()
        } else {
            queue.front().cloned()
        }
    };
    if !shared.latency.is_zero() {
        tokio::time::sleep(shared.latency).await;
    }
    let response = respond(reply).await;
    if let Ok(mut fleet) = shared.fleet.lock()
        && let Some(n) = fleet.in_flight.get_mut(&destination)
    {
        *n -= 1;
    }
    response
}

/// The HTTP answer a scripted reply stands for (none scripted: 404).
async fn respond(reply: Option<Reply>) -> Response {
    match reply {
        None => (
            StatusCode::NOT_FOUND,
            axum::Json(serde_json::json!({"errcode": "M_NOT_FOUND"})),
        )
            .into_response(),
        Some(Reply::Json(body)) => axum::Json(body).into_response(),
        Some(Reply::Raw(bytes)) => Response::new(Body::from(bytes)),
        Some(Reply::Status(code, body, retry_after)) => {
            let mut response = (
                StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                axum::Json(body),
            )
                .into_response();
            if let Some(seconds) = retry_after
                && let Ok(value) = seconds.to_string().parse()
            {
                response.headers_mut().insert("retry-after", value);
            }
            response
        }
        Some(Reply::Hang) => {
            // Leave the request counted in flight: a hanging server is busy.
            std::future::pending::<()>().await;
            unreachable!()
        }
        Some(Reply::Held(gate, then)) => {
            gate.notified().await;
            Box::pin(respond(Some(*then))).await
        }
    }
}

/// A fleet for a worker run as a process: a new key of our server
/// (`origin`) written to a file of its own, and a fleet that trusts it.
pub struct KeyedFleet {
    /// The fleet.
    pub fleet: MockFederation,
    /// Our server's key (for a worker started in-process beside it).
    pub key: crate::server_key::ServerKey,
    /// The key file the worker reads (`DLU_SIGNING_KEY_PATH`).
    pub key_path: std::path::PathBuf,
    /// Holds the key file.
    _dir: tempfile::TempDir,
}

impl KeyedFleet {
    /// Writes a new key and starts a fleet trusting it.
    pub async fn start(origin: &str, latency: Duration) -> KeyedFleet {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let key_path = dir.path().join("signing.key");
        let key = crate::server_key::ServerKey::generate().expect("a new key");
        key.write_new(&key_path).expect("key file written");
        KeyedFleet {
            fleet: MockFederation::trusting_key(origin, &key, latency).await,
            key,
            key_path,
            _dir: dir,
        }
    }
}

/// A device-list answer for `user` with `devices` (device id, display name),
/// each with keys that name the user and the device.
pub fn device_list(user: &str, stream_id: i64, devices: &[(&str, &str)]) -> serde_json::Value {
    let devices: Vec<serde_json::Value> = devices
        .iter()
        .map(|(device, name)| {
            serde_json::json!({
                "device_id": device,
                "device_display_name": name,
                "keys": device_keys(user, device),
            })
        })
        .collect();
    serde_json::json!({"user_id": user, "stream_id": stream_id, "devices": devices})
}

/// Device keys that name `user` and `device`.
pub fn device_keys(user: &str, device: &str) -> serde_json::Value {
    serde_json::json!({
        "user_id": user, "device_id": device,
        "algorithms": ["m.olm.v1.curve25519-aes-sha2", "m.megolm.v1.aes-sha2"],
        "keys": {format!("curve25519:{device}"): "3C5BFWi2Y8MaVvjM8M22DBmh24PmgR0nPvJOIArzgyI",
                 format!("ed25519:{device}"): format!("lEuiRJBit0IG6nUf5pUzWTUEsRVVe{device}")},
        "signatures": {}
    })
}

/// Overrides mapping each of `servers` to the fleet.
pub fn overrides_for<'a>(
    fleet: &MockFederation,
    servers: impl IntoIterator<Item = &'a str>,
) -> BTreeMap<ruma::OwnedServerName, String> {
    servers
        .into_iter()
        .filter_map(|s| ruma::OwnedServerName::try_from(s).ok())
        .map(|s| (s, fleet.base_url()))
        .collect()
}
