//! The federation client: a signed `GET /_matrix/federation/v1/user/devices/{userId}`
//! to the server that owns the user, found by server discovery, through the
//! outbound guard.
//!
//! Signing uses ruma's X-Matrix implementation (canonical JSON of the request
//! object, ed25519). Discovery follows the server-server spec: IP literals,
//! explicit ports, `.well-known/matrix/server` delegation (cached), then SRV
//! `_matrix-fed._tcp` / `_matrix._tcp` and port 8448 (`fetch::discovery`).
//! For a name found through SRV the URL keeps the server's hostname (so TLS
//! and `Host` name it, as the spec requires) and the DNS hook hands reqwest
//! the discovered addresses and ports.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use ruma::api::federation::authentication::{XMatrix, XMatrixSigningInput};
use ruma::signatures::Ed25519KeyPair;
use ruma::{OwnedServerName, ServerName, UserId};

use super::answer;
use super::discovery::{self, HickoryDns};
use super::error::ClientError;
use super::guard;
use super::retry::FailureKind;
use crate::decide::fetched::FetchedList;

/// Largest answer body read (SPEC §5.2).
pub const MAX_BODY: usize = 10 * 1024 * 1024;
/// Port of a server name without one and without delegation.
const DEFAULT_PORT: u16 = 8448;
/// How long a well-known answer (or its absence) is trusted.
const WELL_KNOWN_TTL: Duration = Duration::from_secs(3600);
/// How long discovered addresses are reused.
const DISCOVERY_TTL: Duration = Duration::from_secs(3600);
/// Largest well-known body read.
const MAX_WELL_KNOWN: usize = 64 * 1024;

/// A failed fetch: what happened (for `fetch::retry::blame`), a wait the
/// remote asked for, and what to log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct FetchFailure {
    /// What went wrong.
    pub kind: FailureKind,
    /// `retry_after_ms` of a 429, or a `Retry-After` header: a floor.
    pub asked: Option<Duration>,
    /// What went wrong, for logs, `last_error` and RPC replies.
    pub reason: String,
}

impl FetchFailure {
    /// A failure with nothing asked.
    pub fn new(kind: FailureKind, reason: impl Into<String>) -> Self {
        FetchFailure {
            kind,
            asked: None,
            reason: reason.into(),
        }
    }

    fn unreachable(reason: impl Into<String>) -> Self {
        FetchFailure::new(FailureKind::Unreachable, reason)
    }
}

/// Characters sent as they are in a path segment: RFC 3986's unreserved set
/// (`A-Z a-z 0-9 - . _ ~`). Everything else, `@`, `:` and `/` included, is
/// percent-encoded, as Synapse's own client does (SPEC §5.2).
const PATH_SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// The request path for `user`'s devices.
pub fn devices_path(user: &UserId) -> String {
    format!(
        "/_matrix/federation/v1/user/devices/{}",
        utf8_percent_encode(user.as_str(), PATH_SEGMENT)
    )
}

/// What the client needs to know.
pub struct FederationSettings {
    /// Our server name (the X-Matrix `origin`).
    pub origin: OwnedServerName,
    /// Our signing key.
    pub key: Ed25519KeyPair,
    /// Fixed base URLs per server: no discovery and no guard for these.
    pub overrides: BTreeMap<OwnedServerName, String>,
    /// Per-request timeout.
    pub timeout: Duration,
}

/// Signs and sends device-list requests.
pub struct FederationClient {
    origin: OwnedServerName,
    key: Ed25519KeyPair,
    overrides: BTreeMap<OwnedServerName, String>,
    /// For discovered targets: the guard filters every DNS answer.
    guarded: reqwest::Client,
    /// For overridden targets (operators point these at private addresses).
    direct: reqwest::Client,
    /// For `.well-known` requests: the guard, but plain DNS (port 443).
    well_known_client: reqwest::Client,
    well_known: Mutex<HashMap<OwnedServerName, (Instant, Option<String>)>>,
    dns: HickoryDns,
    discovered: Discoveries,
    refused: Arc<AtomicU64>,
}

/// Addresses found by SRV discovery, per hostname, for the DNS hook.
type Discoveries = Arc<Mutex<HashMap<String, (Instant, Vec<SocketAddr>)>>>;

/// A reqwest DNS hook that drops every address the guard refuses. With
/// `discovered`, a hostname that discovery resolved gets those addresses
/// (and their ports) instead of a plain lookup.
struct GuardedResolver {
    refused: Arc<AtomicU64>,
    discovered: Option<Discoveries>,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let refused = self.refused.clone();
        let host = name.as_str().to_owned();
        let known = self.discovered.as_ref().and_then(|d| {
            let map = d.lock().ok()?;
            let (at, addrs) = map.get(&host)?;
            (at.elapsed() < DISCOVERY_TTL).then(|| addrs.clone())
        });
        Box::pin(async move {
            if let Some(addrs) = known {
                let addrs: reqwest::dns::Addrs = Box::new(addrs.into_iter());
                return Ok(addrs);
            }
            let found: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let allowed: Vec<SocketAddr> = found
                .iter()
                .copied()
                .filter(|a| guard::is_allowed(a.ip()))
                .collect();
            if allowed.is_empty() {
                refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%host, addresses = ?found, "refusing to connect: no public address");
                return Err(format!("{host} resolves only to refused addresses").into());
            }
            let addrs: reqwest::dns::Addrs = Box::new(allowed.into_iter());
            Ok(addrs)
        })
    }
}

/// Where a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    /// `https://host:port` (or an override's URL).
    base_url: String,
    /// Whether it is an override (sent without the guard).
    overridden: bool,
}

impl FederationClient {
    /// A client; fails only if TLS cannot be set up.
    pub fn new(settings: FederationSettings) -> Result<FederationClient, ClientError> {
        crate::tls::install_crypto_provider();
        let refused = Arc::new(AtomicU64::new(0));
        let discovered: Discoveries = Arc::default();
        let dns = HickoryDns::from_system()?;
        let builder = || {
            reqwest::Client::builder()
                .timeout(settings.timeout)
                .connect_timeout(settings.timeout)
                // A redirect could point anywhere, the guard included.
                .redirect(reqwest::redirect::Policy::none())
                .user_agent(concat!("device-list-updater/", env!("CARGO_PKG_VERSION")))
        };
        let guarded = builder()
            .dns_resolver(Arc::new(GuardedResolver {
                refused: refused.clone(),
                discovered: Some(discovered.clone()),
            }))
            .build()?;
        let well_known_client = builder()
            .dns_resolver(Arc::new(GuardedResolver {
                refused: refused.clone(),
                discovered: None,
            }))
            .build()?;
        let direct = builder().build()?;
        Ok(FederationClient {
            origin: settings.origin,
            key: settings.key,
            overrides: settings.overrides,
            guarded,
            direct,
            well_known_client,
            well_known: Mutex::new(HashMap::new()),
            dns,
            discovered,
            refused,
        })
    }

    /// How many connections the guard has refused so far.
    pub fn refused_connections(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Fetches `user`'s device list from its server. Returns the list and
    /// how many device entries were unreadable.
    #[tracing::instrument(
        name = "federation_request",
        skip(self),
        fields(user = %user, server = %user.server_name(), status = tracing::field::Empty)
    )]
    pub async fn get_devices(&self, user: &UserId) -> Result<(FetchedList, usize), FetchFailure> {
        let destination = user.server_name();
        // Boxed: discovery (DNS, `.well-known`) is the largest state of a
        // fetch, and every job in flight would otherwise reserve room for
        // it for the whole request (a thousand jobs at the default
        // concurrency).
        let target = Box::pin(self.target(destination)).await?;
        let (url, authorization) = self.signed_request(&target, user)?;
        let client = if target.overridden {
            &self.direct
        } else {
            &self.guarded
        };
        let response = client
            .get(url)
            .header(reqwest::header::AUTHORIZATION, authorization)
            .send()
            .await
            .map_err(|e| {
                FetchFailure::unreachable(format!("{destination}: {}", error_chain(&e)))
            })?;
        let status = response.status();
        tracing::Span::current().record("status", status.as_u16());
        let retry_after = retry_after_header(response.headers());
        let body = match read_capped(response, MAX_BODY).await {
            Ok(body) => body,
            Err(BodyError::TooLarge) => {
                return Err(FetchFailure::new(
                    FailureKind::TooLarge,
                    format!("{destination}: answer larger than {MAX_BODY} bytes"),
                ));
            }
            Err(BodyError::Read(e)) => {
                return Err(FetchFailure::unreachable(format!("{destination}: {e}")));
            }
        };
        if status.is_success() {
            return answer::parse(&body).map_err(|e| {
                FetchFailure::new(FailureKind::NotAList, format!("{destination}: {e}"))
            });
        }
        Err(status_failure(status, retry_after, &body, destination))
    }

    /// The URL for `user`'s devices at `target` and its X-Matrix
    /// `Authorization` value, signed over exactly the path that is sent.
    fn signed_request(
        &self,
        target: &Target,
        user: &UserId,
    ) -> Result<(reqwest::Url, reqwest::header::HeaderValue), FetchFailure> {
        let local = |e: &dyn std::fmt::Display| {
            FetchFailure::new(FailureKind::Local, format!("cannot build the request: {e}"))
        };
        let url = reqwest::Url::parse(&format!("{}{}", target.base_url, devices_path(user)))
            .map_err(|e| local(&e))?;
        // What the remote rebuilds the signed object from: the path and
        // query as they go on the wire, after the URL parser's normalisation.
        let uri = match url.query() {
            Some(query) => format!("{}?{query}", url.path()),
            None => url.path().to_owned(),
        };
        let request = http::Request::get(uri)
            .body(Vec::<u8>::new())
            .map_err(|e| local(&e))?;
        let x_matrix = XMatrix::sign_http_request(
            &request,
            XMatrixSigningInput::new(
                self.origin.clone(),
                user.server_name().to_owned(),
                &self.key,
            ),
        )
        .map_err(|e| local(&e))?;
        Ok((url, reqwest::header::HeaderValue::from(&x_matrix)))
    }

    /// Picks where to send requests for `server`.
    async fn target(&self, server: &ServerName) -> Result<Target, FetchFailure> {
        if let Some(base) = self.overrides.get(server) {
            return Ok(Target {
                base_url: base.trim_end_matches('/').to_owned(),
                overridden: true,
            });
        }
        if let Some(target) = literal_or_port(server)? {
            return Ok(target);
        }
        // A hostname without a port: delegation first, then SRV / 8448.
        let delegated = self.well_known(server).await;
        let name = match delegated.as_deref().map(OwnedServerName::try_from) {
            Some(Ok(name)) => {
                if let Some(target) = literal_or_port(&name)? {
                    return Ok(target);
                }
                name
            }
            _ => server.to_owned(),
        };
        self.discover(name.host()).await
    }

    /// SRV / port-8448 discovery for a bare hostname; the addresses go to the
    /// DNS hook and the URL keeps the hostname (TLS and `Host` name it).
    async fn discover(&self, host: &str) -> Result<Target, FetchFailure> {
        let cached = self.discovered.lock().ok().and_then(|map| {
            let (at, addrs) = map.get(host)?;
            (at.elapsed() < DISCOVERY_TTL).then(|| addrs.clone())
        });
        let target = Target {
            base_url: format!("https://{host}"),
            overridden: false,
        };
        if cached.is_some_and(|addrs| !addrs.is_empty()) {
            return Ok(target);
        }
        let found = discovery::discover(&self.dns, host).await;
        if !found.refused.is_empty() {
            self.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%host, refused = ?found.refused, "discovery found addresses we never connect to");
        }
        if found.addrs.is_empty() {
            return Err(FetchFailure::unreachable(if found.refused.is_empty() {
                format!("{host} does not resolve")
            } else {
                format!("{host} resolves only to refused addresses")
            }));
        }
        if let Ok(mut map) = self.discovered.lock() {
            map.insert(host.to_owned(), (Instant::now(), found.addrs));
        }
        Ok(target)
    }

    /// `m.server` of `https://<server>/.well-known/matrix/server`, cached.
    async fn well_known(&self, server: &ServerName) -> Option<String> {
        if let Ok(cache) = self.well_known.lock()
            && let Some((at, value)) = cache.get(server)
            && at.elapsed() < WELL_KNOWN_TTL
        {
            return value.clone();
        }
        let url = format!("https://{}/.well-known/matrix/server", server.host());
        let value = async {
            let response = self.well_known_client.get(&url).send().await.ok()?;
            if !response.status().is_success() {
                return None;
            }
            let body = read_capped(response, MAX_WELL_KNOWN).await.ok()?;
            let json: serde_json::Value = serde_json::from_slice(&body).ok()?;
            json.get("m.server")?.as_str().map(str::to_owned)
        }
        .await;
        if let Ok(mut cache) = self.well_known.lock() {
            cache.insert(server.to_owned(), (Instant::now(), value.clone()));
        }
        value
    }
}

/// The target of an IP literal or a name with an explicit port (None for a
/// bare hostname). IP literals are checked by the guard here, since they
/// never reach the DNS hook.
fn literal_or_port(server: &ServerName) -> Result<Option<Target>, FetchFailure> {
    let host = server.host();
    let port = server.port().unwrap_or(DEFAULT_PORT);
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        if !guard::is_allowed(ip) {
            return Err(FetchFailure::unreachable(format!(
                "{server}: refusing to connect to {ip}"
            )));
        }
        return Ok(Some(Target {
            base_url: format!("https://{}", SocketAddr::new(ip, port)),
            overridden: false,
        }));
    }
    Ok(server.port().map(|port| Target {
        base_url: format!("https://{host}:{port}"),
        overridden: false,
    }))
}

/// Why a body was not read.
#[derive(Debug)]
enum BodyError {
    /// More than the cap.
    TooLarge,
    /// The connection failed while reading.
    Read(String),
}

/// Reads at most `cap` bytes of a body; more is an error.
async fn read_capped(mut response: reqwest::Response, cap: usize) -> Result<Vec<u8>, BodyError> {
    if response.content_length().is_some_and(|n| n > cap as u64) {
        return Err(BodyError::TooLarge);
    }
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| BodyError::Read(error_chain(&e)))?
    {
        if body.len() + chunk.len() > cap {
            return Err(BodyError::TooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// `Retry-After` in seconds (HTTP dates are rare from homeservers; ignored).
fn retry_after_header(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

/// A non-2xx answer: its status, and the wait it asks for (a 429's
/// `retry_after_ms`, else a `Retry-After` header on any status).
fn status_failure(
    status: reqwest::StatusCode,
    retry_after: Option<Duration>,
    body: &[u8],
    server: &ServerName,
) -> FetchFailure {
    let from_body = (status == reqwest::StatusCode::TOO_MANY_REQUESTS)
        .then(|| {
            serde_json::from_slice::<serde_json::Value>(body)
                .ok()?
                .get("retry_after_ms")?
                .as_u64()
        })
        .flatten()
        .map(Duration::from_millis);
    FetchFailure {
        kind: FailureKind::Status(status.as_u16()),
        asked: from_body.or(retry_after),
        reason: format!("{server} answered {status}"),
    }
}

/// An error with its sources, which is where reqwest says what happened.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> OwnedServerName {
        OwnedServerName::try_from(s).unwrap()
    }

    #[test]
    fn literals_and_ports() {
        let base = |s: &str| literal_or_port(&name(s)).unwrap().map(|t| t.base_url);
        assert_eq!(base("1.2.3.4"), Some("https://1.2.3.4:8448".into()));
        assert_eq!(base("1.2.3.4:99"), Some("https://1.2.3.4:99".into()));
        assert_eq!(
            base("[2001:4860::1]:443"),
            Some("https://[2001:4860::1]:443".into())
        );
        assert_eq!(
            base("example.org:8000"),
            Some("https://example.org:8000".into())
        );
        assert_eq!(base("example.org"), None);
    }

    #[test]
    fn refused_literals() {
        for server in [
            "127.0.0.1",
            "127.0.0.1:8008",
            "10.0.0.1",
            "[::1]:80",
            "169.254.169.254",
        ] {
            assert!(literal_or_port(&name(server)).is_err(), "{server}");
        }
    }

    #[test]
    fn status_table() {
        let s = name("r.example");
        /// (status, body, Retry-After s, asked ms)
        type Row = (u16, &'static [u8], Option<u64>, Option<u64>);
        let table: [Row; 6] = [
            // (status, body, Retry-After s, asked ms)
            (
                429,
                br#"{"errcode":"M_LIMIT_EXCEEDED","retry_after_ms":2500}"#,
                None,
                Some(2500),
            ),
            // retry_after_ms wins over the header on a 429
            (429, br#"{"retry_after_ms":2500}"#, Some(9), Some(2500)),
            (429, b"", Some(7), Some(7000)),
            (429, b"not json", None, None),
            (503, b"", Some(30), Some(30_000)),
            (404, br#"{"retry_after_ms":2500}"#, None, None),
        ];
        for (status, body, header, asked) in table {
            let failure = status_failure(
                reqwest::StatusCode::from_u16(status).unwrap(),
                header.map(Duration::from_secs),
                body,
                &s,
            );
            assert_eq!(failure.kind, FailureKind::Status(status));
            assert_eq!(failure.asked, asked.map(Duration::from_millis), "{status}");
        }
    }

    #[test]
    fn user_ids_are_encoded_outside_unreserved() {
        let table = [
            (
                "@carol/q+r=s:remote.test",
                "%40carol%2Fq%2Br%3Ds%3Aremote.test",
            ),
            ("@al~ice_.-9:remote.test", "%40al~ice_.-9%3Aremote.test"),
            ("@bob:remote.test:8448", "%40bob%3Aremote.test%3A8448"),
            ("@x:[::1]:80", "%40x%3A%5B%3A%3A1%5D%3A80"),
        ];
        for (user, encoded) in table {
            let user = <&UserId>::try_from(user).unwrap();
            assert_eq!(
                devices_path(user),
                format!("/_matrix/federation/v1/user/devices/{encoded}"),
                "{user}"
            );
        }
    }
}
