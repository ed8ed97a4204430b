//! Checking one input message: deliveries, subject, body and the input
//! rules (SPEC §5.1.1). What the checks make of it travels with it.

use async_nats::jetstream::Message;

use super::Ingest;
use crate::input::{self, DeadReason, InputMessage, Parsed, Rejection};

/// One message of a batch and what the checks made of it.
pub(super) struct Item {
    /// The message as delivered.
    pub(super) message: Message,
    /// Accepted (or ignored), or why it is dead-lettered.
    pub(super) verdict: Result<Parsed, Rejection>,
}

impl Ingest {
    /// Checks one message: deliveries, subject, body and the input rules.
    pub(super) fn check(&self, message: Message) -> Item {
        let delivered = message.info().map(|i| i.delivered).unwrap_or(1);
        let verdict = if delivered >= self.max_deliver && self.max_deliver > 1 {
            Err(Rejection::new(
                DeadReason::MaxDeliver,
                format!("delivered {delivered} times without being processed"),
            ))
        } else {
            match self.subjects.kind_of(message.subject.as_str()) {
                None => Err(Rejection::new(
                    DeadReason::UnknownSubject,
                    format!("no input is configured on subject {}", message.subject),
                )),
                Some(kind) => {
                    let origin = message
                        .headers
                        .as_ref()
                        .and_then(|h| h.get("origin"))
                        .map(|v| v.as_str());
                    let rules = input::Rules {
                        own_server: &self.own_server,
                        tracking: &self.tracking,
                    };
                    input::parse(kind, &message.payload, origin, &rules)
                }
            }
        };
        if let Ok(Parsed::Accept(InputMessage::SigningKey(keys))) = &verdict
            && !keys.dropped.is_empty()
        {
            tracing::warn!(user_id = %keys.user_id, dropped = ?keys.dropped, "ignored malformed cross-signing keys");
        }
        Item { message, verdict }
    }
}
