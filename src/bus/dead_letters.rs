//! Dead letters (SPEC §4.3): the original body and headers, plus `error` and
//! `source_subject`, on `devicelist.dead.<reason>`.

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use async_nats::jetstream::context::PublishAckFuture;
use bytes::Bytes;

use super::BusError;
use crate::input::DeadReason;

/// One message to dead-letter.
#[derive(Debug)]
pub struct DeadLetter<'a> {
    /// Why it is dead.
    pub reason: DeadReason,
    /// A human sentence.
    pub error: &'a str,
    /// The subject it arrived on (a routed copy's: the input's).
    pub source_subject: &'a str,
    /// Its headers.
    pub headers: Option<&'a HeaderMap>,
    /// Its body.
    pub body: Bytes,
    /// `<stream>:<sequence>` of the input message: the dead letter's
    /// `Nats-Msg-Id`, so a redelivered message is dead-lettered once.
    pub origin_id: String,
}

/// Publishes a dead letter; the returned future resolves when it is stored.
pub async fn publish(js: &Context, dead: DeadLetter<'_>) -> Result<PublishAckFuture, BusError> {
    let mut headers = HeaderMap::new();
    if let Some(original) = dead.headers {
        for (name, values) in original.iter() {
            // JetStream's publish conditions (`Nats-Expected-*`, on every
            // routed copy of an input message) would refuse the letter.
            let name_text = AsRef::<str>::as_ref(name).to_ascii_lowercase();
            if name_text.starts_with("nats-expected-")
                || name_text == super::parts::SOURCE_SUBJECT.to_ascii_lowercase()
            {
                continue;
            }
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
    }
    headers.insert("error", one_line(dead.error).as_str());
    headers.insert("source_subject", dead.source_subject);
    headers.insert(
        async_nats::header::NATS_MESSAGE_ID,
        format!("dead:{}", dead.origin_id).as_str(),
    );
    js.publish_with_headers(
        format!("devicelist.dead.{}", dead.reason.as_str()),
        headers,
        dead.body,
    )
    .await
    .map_err(BusError::jetstream("cannot publish a dead letter"))
}

/// Header values cannot hold line breaks.
fn one_line(text: &str) -> String {
    text.replace(['\r', '\n'], " ")
}
