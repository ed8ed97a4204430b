//! Logs and traces. Logs go to stderr as text or JSON (the `log_format` setting),
//! filtered by `RUST_LOG`. Traces are exported over OTLP/HTTP only when the
//! standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or `…_TRACES_ENDPOINT`) variable is
//! set; otherwise no exporter and no OpenTelemetry layer exist, so spans cost
//! what plain `tracing` spans cost. Protocol, headers, batching and so on
//! follow the other `OTEL_*` variables (`OTEL_EXPORTER_OTLP_PROTOCOL`:
//! `http/protobuf`, the default, or `http/json`).

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::config::LogFormat;

/// Why logging or tracing could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The OTLP exporter's `OTEL_*` settings are unusable.
    #[error("configuration: OTLP trace exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    /// A logger was already installed.
    #[error("cannot set up logging: {0}")]
    Logging(#[from] tracing_subscriber::util::TryInitError),
}

/// Keeps the trace exporter alive; [`Telemetry::shutdown`] flushes it.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Sets up logging (at `default_level` unless `RUST_LOG` says
    /// otherwise) and, if configured, trace export. Call once.
    pub fn init(log_format: LogFormat, default_level: &str) -> Result<Telemetry, TelemetryError> {
        // The OTLP client is a reqwest client too: it needs the TLS provider.
        crate::tls::install_crypto_provider();
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
        let logs = match log_format {
            // Colours only on a terminal: a log file or journald gets
            // plain text.
            LogFormat::Text => tracing_subscriber::fmt::layer()
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_writer(std::io::stderr)
                .boxed(),
            LogFormat::Json => tracing_subscriber::fmt::layer()
                .json()
                .with_writer(std::io::stderr)
                .boxed(),
        };
        let configured = [
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ]
        .iter()
        .any(|key| std::env::var(key).is_ok_and(|v| !v.trim().is_empty()));
        let provider = if configured {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .build()?;
            Some(
                SdkTracerProvider::builder()
                    .with_batch_exporter(exporter)
                    .with_resource(
                        opentelemetry_sdk::Resource::builder()
                            .with_service_name("device-list-updater")
                            .build(),
                    )
                    .build(),
            )
        } else {
            None
        };
        let traces = provider
            .as_ref()
            .map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("device-list-updater")));
        tracing_subscriber::registry()
            .with(filter)
            .with(logs)
            .with(traces)
            .try_init()?;
        Ok(Telemetry { provider })
    }

    /// Sends the spans still buffered.
    pub fn shutdown(self) {
        if let Some(provider) = self.provider
            && let Err(e) = provider.shutdown()
        {
            eprintln!("device-list-updater: trace export shutdown: {e}");
        }
    }
}
