//! Streams and consumers of SPEC §4: created when missing, adopted when a
//! homeserver already owns a stream that captures the subjects.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::stream::{self, DiscardPolicy, RetentionPolicy};

use super::BusError;

/// Input stream created when no stream captures the input subjects.
pub const INPUT_STREAM: &str = "DEVICE_LIST_INPUT";
/// Key-change output stream.
pub const KEY_CHANGE_STREAM: &str = "KEY_CHANGE";
/// Dead-letter stream.
pub const DEAD_STREAM: &str = "DEVICE_LIST_DEAD";
/// Fetch-job work queue (one pending job per remote server).
pub const FETCH_STREAM: &str = "DEVICE_LIST_FETCH";
/// Durable name of the input consumer.
pub const INPUT_CONSUMER: &str = "device-list-updater-input";

const DAY: Duration = Duration::from_secs(24 * 3600);

/// Default configuration of the input stream.
pub fn input_stream_config() -> stream::Config {
    stream::Config {
        name: INPUT_STREAM.into(),
        subjects: vec!["devicelist.in.>".into()],
        max_age: 7 * DAY,
        ..Default::default()
    }
}

/// Configuration of `KEY_CHANGE`. The duplicate window absorbs re-sends of
/// outbox events after a crash between publish and delete.
pub fn key_change_stream_config() -> stream::Config {
    stream::Config {
        name: KEY_CHANGE_STREAM.into(),
        subjects: vec!["key_change.>".into()],
        max_age: 7 * DAY,
        duplicate_window: Duration::from_secs(600),
        ..Default::default()
    }
}

/// Configuration of `DEVICE_LIST_DEAD`.
pub fn dead_stream_config() -> stream::Config {
    stream::Config {
        name: DEAD_STREAM.into(),
        subjects: vec!["devicelist.dead.>".into()],
        max_age: 30 * DAY,
        ..Default::default()
    }
}

/// Configuration of the fetch-job queue: a work queue that keeps at most one
/// message per subject (one subject per remote server), refusing a second.
pub fn fetch_stream_config() -> stream::Config {
    stream::Config {
        name: FETCH_STREAM.into(),
        subjects: vec!["devicelist.fetch.>".into()],
        retention: RetentionPolicy::WorkQueue,
        max_messages_per_subject: 1,
        discard: DiscardPolicy::New,
        discard_new_per_subject: true,
        ..Default::default()
    }
}

/// Whether `subject` matches the NATS pattern `pattern` (`*` and `>` wildcards).
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut pattern = pattern.split('.');
    let mut subject = subject.split('.');
    loop {
        match (pattern.next(), subject.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(p), Some(s)) if p == s => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Finds the stream capturing each subject; subjects no stream captures are
/// given to `fallback`, which is created. Returns subjects grouped by stream.
pub async fn ensure_subjects(
    js: &Context,
    subjects: &[String],
    fallback: stream::Config,
) -> Result<BTreeMap<String, Vec<String>>, BusError> {
    let mut by_stream: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut missing = Vec::new();
    for subject in subjects {
        match js.stream_by_subject(subject.as_str()).await {
            Ok(name) => by_stream.entry(name).or_default().push(subject.clone()),
            Err(_) => missing.push(subject.clone()),
        }
    }
    if !missing.is_empty() {
        let mut config = fallback;
        let covered = missing
            .iter()
            .all(|s| config.subjects.iter().any(|p| subject_matches(p, s)));
        if !covered {
            config.subjects = missing.clone();
        }
        let name = config.name.clone();
        js.get_or_create_stream(config)
            .await
            .map_err(BusError::jetstream(format!("cannot create stream {name}")))?;
        by_stream.entry(name).or_default().extend(missing);
    }
    Ok(by_stream)
}

/// The streams the worker uses, and warnings about those with fewer
/// replicas than configured.
pub struct Ensured {
    /// The input subjects grouped by the stream that holds them.
    pub inputs: BTreeMap<String, Vec<String>>,
    /// One line per stream in use with fewer replicas than configured. Such
    /// a stream is never changed: it may be the homeserver's.
    pub warnings: Vec<String>,
}

/// Creates (or adopts) every stream the worker needs, new ones with
/// `replicas` replicas.
pub async fn ensure_all(
    js: &Context,
    input_subjects: &[String],
    replicas: usize,
) -> Result<Ensured, BusError> {
    let outputs = [
        (
            vec![
                "key_change.device".to_owned(),
                "key_change.cross_signing".to_owned(),
            ],
            key_change_stream_config(),
        ),
        (
            vec!["devicelist.dead.not_json".to_owned()],
            dead_stream_config(),
        ),
        (vec!["devicelist.fetch.x".to_owned()], fetch_stream_config()),
    ];
    let replicated = |config: stream::Config| stream::Config {
        num_replicas: replicas,
        ..config
    };
    let mut used = std::collections::BTreeSet::new();
    for (subjects, config) in outputs {
        used.extend(
            ensure_subjects(js, &subjects, replicated(config))
                .await?
                .into_keys(),
        );
    }
    let inputs = ensure_subjects(js, input_subjects, replicated(input_stream_config())).await?;
    used.extend(inputs.keys().cloned());
    let mut warnings = Vec::new();
    for name in used {
        warnings.extend(replica_warning(js, &name, replicas).await);
    }
    Ok(Ensured { inputs, warnings })
}

/// A warning if stream `name` exists with fewer than `wanted` replicas.
pub async fn replica_warning(js: &Context, name: &str, wanted: usize) -> Option<String> {
    let mut stream = js.get_stream(name).await.ok()?;
    let info = stream.info().await.ok()?;
    too_few_replicas(name, info.config.num_replicas, wanted)
}

/// A warning if stream `name` has `has` replicas (0: the server's default,
/// one) and `wanted` are configured.
fn too_few_replicas(name: &str, has: usize, wanted: usize) -> Option<String> {
    let has = has.max(1);
    (has < wanted).then(|| {
        format!(
            "stream {name} has {has} replica(s), fewer than DLU_STREAM_REPLICAS={wanted}; \
             losing the node that holds it stops the service (it is not changed here)"
        )
    })
}

/// Settings of the input consumer.
#[derive(Clone, Debug)]
pub struct InputConsumerSettings {
    /// Deliveries before a message is dead-lettered.
    pub max_deliver: i64,
    /// Messages handed out but not yet acked.
    pub max_ack_pending: i64,
    /// Redelivery wait of unacked messages.
    pub ack_wait: Duration,
}

/// Creates (or opens) the durable pull consumer on `stream_name`. Only the
/// replica holding the stream's lease pulls from it.
pub async fn input_consumer(
    js: &Context,
    stream_name: &str,
    subjects: &[String],
    settings: &InputConsumerSettings,
) -> Result<PullConsumer, BusError> {
    durable_consumer(
        js,
        stream_name,
        INPUT_CONSUMER,
        "device-list-updater: device-list and signing-key updates".into(),
        subjects.to_vec(),
        settings,
    )
    .await
}

/// Creates (or opens) the durable, explicitly acked pull consumer `durable`
/// on `stream_name`, taking the messages of `subjects`: the shape of every
/// consumer that ingests input, whole or one partition of it.
pub(super) async fn durable_consumer(
    js: &Context,
    stream_name: &str,
    durable: &str,
    description: String,
    subjects: Vec<String>,
    settings: &InputConsumerSettings,
) -> Result<PullConsumer, BusError> {
    let stream = js
        .get_stream(stream_name)
        .await
        .map_err(BusError::jetstream(format!(
            "cannot open stream {stream_name}"
        )))?;
    let config = pull::Config {
        durable_name: Some(durable.into()),
        description: Some(description),
        filter_subjects: subjects,
        ack_policy: AckPolicy::Explicit,
        ack_wait: settings.ack_wait,
        max_deliver: settings.max_deliver,
        max_ack_pending: settings.max_ack_pending,
        ..Default::default()
    };
    stream
        .get_or_create_consumer(durable, config)
        .await
        .map_err(BusError::jetstream(format!(
            "cannot create consumer {durable} on {stream_name}"
        )))
}

#[cfg(test)]
mod tests {
    use super::subject_matches;

    #[test]
    fn wildcards() {
        assert!(subject_matches("devicelist.in.>", "devicelist.in.update"));
        assert!(subject_matches("devicelist.in.>", "devicelist.in.a.b"));
        assert!(!subject_matches("devicelist.in.>", "devicelist.in"));
        assert!(subject_matches("a.*.c", "a.b.c"));
        assert!(!subject_matches("a.*.c", "a.b.d"));
        assert!(subject_matches(
            "DendriteInputDeviceListUpdate",
            "DendriteInputDeviceListUpdate"
        ));
        assert!(!subject_matches("a.b", "a.b.c"));
    }
}
