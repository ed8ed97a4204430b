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
    /// JetStream answered, but what was asked did not take effect (a
    /// finished fetch job still in its stream); it is asked again.
    #[error("{0}")]
    NotApplied(String),
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

impl BusError {
    /// Whether waiting may mend it: JetStream did not answer in time or
    /// was not available yet (a cluster still electing its leaders). Told
    /// by the async-nats error's kind, never by its text.
    pub fn is_transient(&self) -> bool {
        use async_nats::jetstream::context::{
            CreateKeyValueError, CreateKeyValueErrorKind, CreateStreamError, CreateStreamErrorKind,
            GetStreamError, GetStreamErrorKind,
        };
        use async_nats::jetstream::stream::{ConsumerError, ConsumerErrorKind};
        let BusError::JetStream { source, .. } = self else {
            return false;
        };
        if let Some(e) = source.downcast_ref::<CreateStreamError>() {
            return matches!(
                e.kind(),
                CreateStreamErrorKind::TimedOut
                    | CreateStreamErrorKind::JetStreamUnavailable
                    | CreateStreamErrorKind::Response
            );
        }
        if let Some(e) = source.downcast_ref::<ConsumerError>() {
            return matches!(
                e.kind(),
                ConsumerErrorKind::TimedOut | ConsumerErrorKind::Request
            );
        }
        if let Some(e) = source.downcast_ref::<CreateKeyValueError>() {
            return matches!(e.kind(), CreateKeyValueErrorKind::TimedOut);
        }
        if let Some(e) = source.downcast_ref::<GetStreamError>() {
            return matches!(e.kind(), GetStreamErrorKind::Request);
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use async_nats::jetstream::context::{CreateStreamError, CreateStreamErrorKind};

    use super::BusError;

    fn creating(kind: CreateStreamErrorKind) -> BusError {
        BusError::jetstream("cannot create stream S")(CreateStreamError::new(kind))
    }

    #[test]
    fn a_timeout_or_an_unready_jetstream_is_worth_waiting_for() {
        assert!(creating(CreateStreamErrorKind::TimedOut).is_transient());
        assert!(creating(CreateStreamErrorKind::JetStreamUnavailable).is_transient());
    }

    #[test]
    fn a_refusal_is_not() {
        assert!(!creating(CreateStreamErrorKind::InvalidStreamName).is_transient());
        assert!(!BusError::NotRouted("x".into()).is_transient());
    }
}
