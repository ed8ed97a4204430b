//! The bus layer's error: what was being done, and the async-nats error.

/// A NATS or JetStream operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// No connection within the start-up wait.
    #[error("cannot connect to NATS at {urls}: {source}")]
    Connect {
        /// The configured URL(s).
        urls: String,
        /// Why.
        #[source]
        source: async_nats::ConnectError,
    },
    /// A NATS credential or TLS file, or a NATS URL, is unusable.
    #[error("NATS credentials: {0}")]
    Credentials(String),
    /// A JetStream request failed.
    #[error("{what}: {source}")]
    JetStream {
        /// What was being done ("cannot open stream X").
        what: String,
        /// The async-nats error.
        #[source]
        source: async_nats::Error,
    },
    /// Messages could not be routed to their input partitions in time
    /// (their input messages are given back, unacked).
    #[error("{0}")]
    NotRouted(String),
}

impl BusError {
    /// Wraps an async-nats error with what was being done (for `map_err`).
    pub(crate) fn jetstream<E>(what: impl Into<String>) -> impl FnOnce(E) -> BusError
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let what = what.into();
        move |e| BusError::JetStream {
            what,
            source: Box::new(e),
        }
    }
}
