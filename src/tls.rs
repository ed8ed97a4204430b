//! TLS set-up shared by every client in the process.

/// Installs rustls' `ring` provider as the process default (async-nats uses
/// `ring` too). With two providers compiled in and none chosen, rustls
/// panics on the first TLS client; installing twice is harmless.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
