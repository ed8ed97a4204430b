//! Input partitions on JetStream (SPEC §4.5; docs/design.md, "Input
//! partitions"). Each input stream the homeserver publishes to has an
//! internal work-queue stream of its partitions, `<input stream>_PARTS`,
//! with subjects `devicelist.part.<input stream>.<partition>.<kind>`. The
//! replica holding the input stream's lease routes each message there, and
//! each partition has a durable consumer of its own (non-overlapping
//! filters, which a work queue allows).
//!
//! The router publishes every message with `Nats-Expected-Last-Sequence`,
//! each the sequence its predecessor gets: a message is stored only right
//! after the one routed before it, so a publish lost in a failure (a
//! killed node, a leader change) can never be overtaken by a later one.
//! Its `Nats-Msg-Id` names the input message, so routing it again after a
//! crash stores nothing new.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::kv::{self, Store};
use async_nats::jetstream::stream::{self, RetentionPolicy};
use bytes::Bytes;
use futures::TryStreamExt as _;

use super::BusError;
use super::streams::{self, InputConsumerSettings};
use crate::input::{InputKind, InputSubjects};

/// Header carrying the subject an input message arrived on.
pub const SOURCE_SUBJECT: &str = "Dlu-Source-Subject";
/// The bucket that records, per input stream, the partition count its
/// partitions were last routed with (kept forever, unlike leases).
pub const COUNTS_BUCKET: &str = "device_list_updater_partitions";
/// How long a routed message's id is remembered: longer than any
/// redelivery to a new router (ack wait plus lease length).
const DUPLICATE_WINDOW: Duration = Duration::from_secs(600);
/// Publishes of one run tried again before the router gives the batch back.
const ATTEMPTS: u32 = 20;

/// The partitions stream of input stream `input`.
pub fn stream_name(input: &str) -> String {
    format!("{input}_PARTS")
}

/// The subject of partition `partition` of `input` for `kind` (`unknown`
/// for a subject no kind is configured on: the ingest dead-letters it).
pub fn subject(input: &str, partition: u16, kind: Option<InputKind>) -> String {
    let token = kind.map_or("unknown", InputKind::token);
    format!("devicelist.part.{input}.{partition}.{token}")
}

/// The subjects of partition `partition` of `input`, by kind: what its
/// ingest reads.
pub fn subjects(input: &str, partition: u16) -> InputSubjects {
    InputSubjects::new(|kind| subject(input, partition, Some(kind)))
}

/// Creates (or opens) the partitions stream of `input`.
pub async fn ensure_stream(js: &Context, input: &str, replicas: usize) -> Result<(), BusError> {
    let name = stream_name(input);
    js.get_or_create_stream(stream::Config {
        name: name.clone(),
        description: Some(format!(
            "device-list-updater: {input}'s messages by input partition"
        )),
        subjects: vec![format!("devicelist.part.{input}.>")],
        retention: RetentionPolicy::WorkQueue,
        duplicate_window: DUPLICATE_WINDOW,
        max_age: Duration::from_secs(7 * 24 * 3600),
        num_replicas: replicas,
        ..Default::default()
    })
    .await
    .map_err(BusError::jetstream(format!("cannot create stream {name}")))?;
    Ok(())
}

/// Creates (or opens) the durable consumer of partition `partition` of
/// `input`.
pub async fn consumer(
    js: &Context,
    input: &str,
    partition: u16,
    settings: &InputConsumerSettings,
) -> Result<PullConsumer, BusError> {
    streams::durable_consumer(
        js,
        &stream_name(input),
        &format!("device-list-updater-part-{partition}"),
        format!("device-list-updater: input partition {partition}"),
        vec![format!("devicelist.part.{input}.{partition}.>")],
        settings,
    )
    .await
}

/// Messages waiting in `input`'s partitions stream (0 if it has none).
pub async fn waiting(js: &Context, input: &str) -> Result<u64, BusError> {
    let name = stream_name(input);
    let Ok(mut stream) = js.get_stream(&name).await else {
        return Ok(0);
    };
    let info = stream
        .info()
        .await
        .map_err(BusError::jetstream(format!("cannot read stream {name}")))?;
    Ok(info.state.messages)
}

/// Opens the partition-count bucket, creating it if `create`; None if it
/// does not exist and was not to be created (no replica has ever routed).
pub async fn counts_bucket(
    js: &Context,
    replicas: usize,
    create: bool,
) -> Result<Option<Store>, BusError> {
    if let Ok(store) = js.get_key_value(COUNTS_BUCKET).await {
        return Ok(Some(store));
    }
    if !create {
        return Ok(None);
    }
    match js
        .create_key_value(kv::Config {
            bucket: COUNTS_BUCKET.into(),
            description:
                "device-list-updater: the partition count each input stream is routed with".into(),
            history: 1,
            num_replicas: replicas,
            ..Default::default()
        })
        .await
    {
        Ok(store) => Ok(Some(store)),
        // Another replica starting at the same moment created it first.
        Err(e) => js
            .get_key_value(COUNTS_BUCKET)
            .await
            .map(Some)
            .map_err(|_| BusError::JetStream {
                what: format!("cannot create KV bucket {COUNTS_BUCKET}"),
                source: Box::new(e),
            }),
    }
}

/// The partition count `input` was last routed with (None: never, or 1).
pub async fn routed_count(counts: &Store, input: &str) -> Result<Option<u16>, BusError> {
    let value = counts
        .get(input)
        .await
        .map_err(BusError::jetstream(format!(
            "cannot read {COUNTS_BUCKET}.{input}"
        )))?;
    Ok(value
        .and_then(|v| std::str::from_utf8(&v).ok()?.parse::<u16>().ok())
        .filter(|&count| count > 1))
}

/// Records that `input` is routed with `count` partitions from now on.
pub async fn set_routed_count(counts: &Store, input: &str, count: u16) -> Result<(), BusError> {
    counts
        .put(input, count.to_string().into())
        .await
        .map_err(BusError::jetstream(format!(
            "cannot write {COUNTS_BUCKET}.{input}"
        )))?;
    Ok(())
}

/// The ids of the live replicas: the keys `replica.<id>` of the lease
/// bucket, each kept alive by its replica and gone with it. One request
/// (the stream's per-subject counts), not one read per key.
pub async fn live_replicas(js: &Context) -> Result<Vec<String>, BusError> {
    let bucket = format!("KV_{}", super::lease::BUCKET);
    let prefix = format!("$KV.{}.{}", super::lease::BUCKET, REPLICA_KEY_PREFIX);
    let stream = js
        .get_stream(&bucket)
        .await
        .map_err(BusError::jetstream(format!("cannot open {bucket}")))?;
    let subjects: Vec<(String, usize)> = stream
        .info_with_subjects(format!("{prefix}>"))
        .await
        .map_err(BusError::jetstream(format!("cannot read {bucket}")))?
        .try_collect()
        .await
        .map_err(BusError::jetstream(format!("cannot read {bucket}")))?;
    Ok(subjects
        .into_iter()
        .filter_map(|(subject, _)| subject.strip_prefix(&prefix).map(str::to_owned))
        .collect())
}

/// Lease-bucket key prefix of the replicas' presence keys.
pub const REPLICA_KEY_PREFIX: &str = "replica.";

/// One message to route: where it goes and what it carries.
pub struct Routed {
    /// Its partition subject.
    pub subject: String,
    /// The input message's headers (less JetStream's own), its source
    /// subject and its id.
    pub headers: HeaderMap,
    /// The body, unchanged.
    pub payload: Bytes,
    /// Whether an earlier router may have stored it already (it was
    /// delivered before): published on its own, not in a run.
    pub maybe_routed: bool,
}

impl Routed {
    /// The input message `id` (`<stream>:<sequence>`) from
    /// `source_subject`, for `subject`. JetStream's own headers of the
    /// input (`Nats-*`: an expected stream, a message id) would refuse or
    /// misplace the routed copy, so they are dropped.
    pub fn new(
        subject: String,
        id: String,
        source_subject: &str,
        original: Option<&HeaderMap>,
        payload: Bytes,
        maybe_routed: bool,
    ) -> Routed {
        let mut headers = HeaderMap::new();
        for (name, values) in original.into_iter().flat_map(HeaderMap::iter) {
            if AsRef::<str>::as_ref(name)
                .to_ascii_lowercase()
                .starts_with("nats-")
            {
                continue;
            }
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
        headers.insert(SOURCE_SUBJECT, source_subject);
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
        Routed {
            subject,
            headers,
            payload,
            maybe_routed,
        }
    }
}

/// Publishes to one partitions stream in order: the router's only way in.
pub struct Chain {
    js: Context,
    stream: String,
    /// The stream's last sequence as this chain last saw it (None: read it
    /// before the next publish).
    last: Option<u64>,
}

impl Chain {
    /// A chain on `input`'s partitions stream.
    pub fn new(js: Context, input: &str) -> Chain {
        Chain {
            js,
            stream: stream_name(input),
            last: None,
        }
    }

    /// Stores `messages` in their order, or fails with none of a later one
    /// stored ahead of an earlier one. Fresh messages go out in runs, each
    /// publish expecting the sequence the one before it gets; a message
    /// that may be stored already goes alone, so that its duplicate ack
    /// (which stores nothing) breaks no run. After a failure, the stream's
    /// last sequence is read again and the rest goes out one by one from
    /// there; `give_up` is asked between attempts that stored nothing.
    pub async fn publish(
        &mut self,
        messages: &[Routed],
        give_up: impl Fn() -> bool,
    ) -> Result<(), BusError> {
        let mut next = 0;
        // Attempts in a row that stored nothing.
        let mut failures = 0;
        // After a failure the stream may hold some of what follows (a
        // publish whose ack was lost): those go alone from then on.
        let mut careful = false;
        while next < messages.len() {
            let last = match self.last {
                Some(last) => last,
                None => self.read_last().await?,
            };
            let end = if careful || messages[next].maybe_routed {
                next + 1
            } else {
                (next..messages.len())
                    .find(|&i| messages[i].maybe_routed)
                    .unwrap_or(messages.len())
            };
            let stored = self.run(&messages[next..end], last).await;
            next += stored;
            if stored > 0 {
                failures = 0;
            }
            if next < end {
                careful = true;
                self.last = None;
                if stored == 0 {
                    failures += 1;
                    if failures >= ATTEMPTS || give_up() {
                        return Err(BusError::NotRouted(format!(
                            "{} messages could not be routed to {}",
                            messages.len() - next,
                            self.stream
                        )));
                    }
                    let pause = Duration::from_millis(50 * u64::from(failures));
                    tokio::time::sleep(pause).await;
                }
            }
        }
        Ok(())
    }

    /// Publishes `run` after sequence `last`; returns how many of its first
    /// messages are stored (a duplicate counts as stored).
    async fn run(&mut self, run: &[Routed], last: u64) -> usize {
        let mut acks: Vec<PublishAckFuture> = Vec::with_capacity(run.len());
        for (offset, message) in (0u64..).zip(run) {
            let mut headers = message.headers.clone();
            headers.insert(
                async_nats::header::NATS_EXPECTED_LAST_SEQUENCE,
                (last + offset).to_string().as_str(),
            );
            match self
                .js
                .publish_with_headers(message.subject.clone(), headers, message.payload.clone())
                .await
            {
                Ok(ack) => acks.push(ack),
                Err(e) => {
                    tracing::info!(error = %e, stream = %self.stream, "routing publish not sent; trying again");
                    break;
                }
            }
        }
        let mut stored = 0;
        for ack in acks {
            match ack.await {
                Ok(ack) => {
                    if !ack.duplicate {
                        self.last = Some(ack.sequence);
                    }
                    stored += 1;
                }
                Err(e) => {
                    // A wrong last sequence follows a duplicate in a run, or
                    // a publish stored after its ack was lost: expected.
                    if e.kind() != PublishErrorKind::WrongLastSequence {
                        tracing::info!(error = %e, stream = %self.stream, "routing publish failed; trying again");
                    }
                    break;
                }
            }
        }
        stored
    }

    /// Reads the stream's last sequence.
    async fn read_last(&mut self) -> Result<u64, BusError> {
        let mut stream = self
            .js
            .get_stream(&self.stream)
            .await
            .map_err(BusError::jetstream(format!("cannot open {}", self.stream)))?;
        let info = stream
            .info()
            .await
            .map_err(BusError::jetstream(format!("cannot read {}", self.stream)))?;
        self.last = Some(info.state.last_sequence);
        Ok(info.state.last_sequence)
    }
}
