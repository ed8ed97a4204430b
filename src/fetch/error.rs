//! Why the federation client could not be set up: shared by the client
//! ([`super::federation`]) and its DNS resolver (`discovery`).

/// Why the federation client could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The system's DNS configuration is unusable.
    #[error("cannot set up DNS from the system configuration: {0}")]
    Dns(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// TLS or the HTTP client could not be built.
    #[error("cannot build the federation client: {0}")]
    Http(#[from] reqwest::Error),
}
