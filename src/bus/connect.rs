//! Connecting to NATS (SPEC §3): credentials in `DLU_NATS_URL` (user and
//! password, or a token), a `.creds` file, an NKey seed file, and TLS with a
//! CA file and an optional client certificate. Secrets never reach a log
//! line or an error: URLs are only ever shown without their user info, and
//! the client is given them without it.

use std::path::PathBuf;
use std::time::Duration;

use async_nats::{ConnectErrorKind, ConnectOptions};

use super::BusError;
use crate::config::{Settings, given};

/// Where NATS is and how to authenticate to it. Its `Debug` shows the URLs
/// without their credentials.
#[derive(Clone, Default)]
pub struct NatsConnection {
    /// Server URL(s), comma-separated; may carry `user:password@` or `token@`.
    pub urls: String,
    /// A `.creds` file (JWT and NKey seed).
    pub creds: Option<PathBuf>,
    /// A file holding an NKey user seed (`SU…`).
    pub nkey_seed: Option<PathBuf>,
    /// CA certificate (PEM) the servers' certificates must chain to; TLS is
    /// then required.
    pub tls_ca: Option<PathBuf>,
    /// Client certificate and its key (PEM), for mutual TLS.
    pub tls_client: Option<(PathBuf, PathBuf)>,
}

impl NatsConnection {
    /// Where NATS is and the credentials to use there, from the settings.
    pub fn from_settings(settings: &Settings) -> NatsConnection {
        NatsConnection {
            urls: settings.nats_url.clone(),
            creds: given(&settings.nats_creds).cloned(),
            nkey_seed: given(&settings.nats_nkey_seed).cloned(),
            tls_ca: given(&settings.nats_tls_ca).cloned(),
            tls_client: given(&settings.nats_tls_cert)
                .cloned()
                .zip(given(&settings.nats_tls_key).cloned()),
        }
    }
}

/// Credentials carried in a URL's user info.
#[derive(Debug, PartialEq, Eq)]
enum UrlAuth {
    /// `nats://user:password@host`.
    UserPassword(String, String),
    /// `nats://token@host`.
    Token(String),
}

impl std::fmt::Debug for NatsConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls = split_credentials(&self.urls)
            .map(|(urls, _)| urls.join(","))
            .unwrap_or_else(|_| "(unparsable NATS URL)".to_owned());
        f.debug_struct("NatsConnection")
            .field("urls", &urls)
            .field("creds", &self.creds)
            .field("nkey_seed", &self.nkey_seed)
            .field("tls_ca", &self.tls_ca)
            .field("tls_client", &self.tls_client)
            .finish()
    }
}

impl NatsConnection {
    /// The client's options: every credential configured.
    async fn options(&self) -> Result<(Vec<String>, ConnectOptions), BusError> {
        let (urls, url_auth) = split_credentials(&self.urls)?;
        let mut options = match &self.creds {
            Some(path) => ConnectOptions::with_credentials_file(path)
                .await
                .map_err(|e| BusError::Credentials(format!("{}: {e}", path.display())))?,
            None => ConnectOptions::new(),
        };
        if let Some(path) = &self.nkey_seed {
            let seed = std::fs::read_to_string(path)
                .map_err(|e| BusError::Credentials(format!("{}: {e}", path.display())))?;
            options = options.nkey(seed.trim().to_owned());
        }
        match url_auth {
            Some(UrlAuth::UserPassword(user, password)) => {
                options = options.user_and_password(user, password);
            }
            Some(UrlAuth::Token(token)) => options = options.token(token),
            None => {}
        }
        if let Some(ca) = &self.tls_ca {
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let Some((cert, key)) = &self.tls_client {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        Ok((urls, options))
    }
}

/// The URLs without user info, and the credentials the first one with user
/// info carries (percent-decoded).
fn split_credentials(urls: &str) -> Result<(Vec<String>, Option<UrlAuth>), BusError> {
    let mut clean = Vec::new();
    let mut auth = None;
    for raw in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let with_scheme = if raw.contains("://") {
            raw.to_owned()
        } else {
            format!("nats://{raw}")
        };
        let mut url = reqwest::Url::parse(&with_scheme)
            .map_err(|e| BusError::Credentials(format!("a NATS URL does not parse: {e}")))?;
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        };
        if auth.is_none() && !url.username().is_empty() {
            auth = Some(match url.password() {
                Some(password) => UrlAuth::UserPassword(decode(url.username()), decode(password)),
                None => UrlAuth::Token(decode(url.username())),
            });
        }
        // Both only fail for URLs that cannot have user info at all.
        let _ = url.set_username("");
        let _ = url.set_password(None);
        clean.push(url.to_string().trim_end_matches('/').to_owned());
    }
    Ok((clean, auth))
}

/// Whether a failed connection is refused for good (a credential or TLS
/// problem), not just not yet possible.
fn refused(error: &async_nats::ConnectError) -> bool {
    matches!(
        error.kind(),
        ConnectErrorKind::AuthorizationViolation
            | ConnectErrorKind::Authentication
            | ConnectErrorKind::Tls
    )
}

/// Connects to NATS, retrying until `wait` has passed unless the server
/// refuses our credentials (that fails at once). After the first connection
/// the client reconnects by itself for as long as the process runs.
pub async fn connect(
    nats: &NatsConnection,
    wait: Duration,
) -> Result<async_nats::Client, BusError> {
    let (urls, options) = nats.options().await?;
    crate::startup::retry_within_unless(
        wait,
        || {
            options
                .clone()
                .name("device-list-updater")
                .max_reconnects(None)
                .connection_timeout(Duration::from_secs(2))
                // Each URL its own server: async-nats parses a single
                // string as one URL, so a joined list would not parse.
                .connect(&urls)
        },
        refused,
    )
    .await
    .map_err(|source| BusError::Connect {
        urls: urls.join(","),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::{UrlAuth, split_credentials};

    #[test]
    fn debug_shows_no_credentials() {
        let nats = super::NatsConnection {
            urls: "nats://dlu:s3cret@a:4222".into(),
            ..Default::default()
        };
        let shown = format!("{nats:?}");
        assert!(
            shown.contains("nats://a:4222") && !shown.contains("s3cret"),
            "{shown}"
        );
    }

    #[test]
    fn credentials_leave_the_urls() {
        let cases: &[(&str, &[&str], Option<UrlAuth>)] = &[
            ("nats://127.0.0.1:4222", &["nats://127.0.0.1:4222"], None),
            (
                "nats://dlu:s%40cret@a:4222, nats://b:4222",
                &["nats://a:4222", "nats://b:4222"],
                Some(UrlAuth::UserPassword("dlu".into(), "s@cret".into())),
            ),
            (
                "tls://t0ken@a:4222",
                &["tls://a:4222"],
                Some(UrlAuth::Token("t0ken".into())),
            ),
            ("a:4222", &["nats://a:4222"], None),
        ];
        for (urls, clean, auth) in cases {
            let (got, got_auth) = split_credentials(urls).unwrap();
            assert_eq!(&got, clean, "{urls}");
            assert_eq!(&got_auth, auth, "{urls}");
        }
    }
}
