//! Every input message that goes to the dead-letter stream (SPEC §4.3), by
//! one path: rejected by the checks, refused by the planner as a link
//! conflict, or refused by the database on its own. A message is acked only
//! once its dead letter is stored.

use async_nats::jetstream::Message;
use async_nats::jetstream::context::PublishAckFuture;

use super::Ingest;
use super::check::Item;
use crate::bus::BusError;
use crate::bus::dead_letters::{self, DeadLetter};
use crate::decide::Outcome;
use crate::input::{DeadReason, InputMessage, Rejection};
use crate::store::Applied;

impl Ingest {
    /// Stores a dead letter for each message the checks rejected. Their
    /// publishes go out together; the batch goes on once every one is stored.
    pub(super) async fn dead_letter_rejected(&self, items: &[Item]) -> Result<(), BusError> {
        let mut acks = Vec::new();
        for item in items {
            if let Err(rejection) = &item.verdict {
                acks.push(self.publish_dead_letter(&item.message, rejection).await?);
            }
        }
        for ack in acks {
            ack.await
                .map_err(BusError::jetstream("a dead letter was not stored"))?;
        }
        Ok(())
    }

    /// Dead-letters the link changes the planner refused as conflicts
    /// (SPEC §5.6.2). They are only known after planning, so they go after
    /// the commit; None if one could not be stored. `covers` names, per
    /// outcome of `applied` in order, its message's place in `accepted`.
    pub(super) async fn dead_letter_conflicts(
        &self,
        items: &[Item],
        accepted: &[(usize, &InputMessage)],
        applied: &[Applied],
        covers: &[usize],
    ) -> Option<()> {
        // A plan has one outcome per message it was given.
        debug_assert_eq!(
            applied.iter().map(|a| a.plan.outcomes.len()).sum::<usize>(),
            covers.len()
        );
        let outcomes = applied.iter().flat_map(|a| a.plan.outcomes.iter().copied());
        for (outcome, &position) in outcomes.zip(covers) {
            if outcome != Outcome::LinkConflict {
                continue;
            }
            let (index, message) = accepted[position];
            // Only a link can conflict.
            let key = match message {
                InputMessage::MemberKey(link) => link.member_key.as_str(),
                InputMessage::Update(_)
                | InputMessage::SigningKey(_)
                | InputMessage::Resync(_)
                | InputMessage::Membership(_) => "",
            };
            let error = format!("member key {key} is already linked to another user in this room");
            let message = &items[index].message;
            self.store_dead_letter(message, DeadReason::LinkConflict, error)
                .await?;
        }
        Some(())
    }

    /// Publishes `message`'s dead letter (`reason`, `error`) and waits until
    /// it is stored; None if it was not.
    pub(super) async fn store_dead_letter(
        &self,
        message: &Message,
        reason: DeadReason,
        error: String,
    ) -> Option<()> {
        let rejection = Rejection::new(reason, error);
        let ack = self.publish_dead_letter(message, &rejection).await.ok()?;
        ack.await.ok().map(drop)
    }

    /// Publishes `message`'s dead letter (its id names the input message, so
    /// a redelivered message's letter is stored once) and counts it.
    async fn publish_dead_letter(
        &self,
        message: &Message,
        rejection: &Rejection,
    ) -> Result<PublishAckFuture, BusError> {
        tracing::info!(reason = %rejection.reason, error = %rejection.error, subject = %message.subject, "dead letter");
        self.metrics.dead_letter(rejection.reason.as_str());
        // A routed copy names its input message: its id and subject.
        let routed = |name: &str| {
            message
                .headers
                .as_ref()
                .filter(|_| self.feed.is_partition())
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_owned())
        };
        let origin_id = routed(async_nats::header::NATS_MESSAGE_ID.as_ref())
            .or_else(|| {
                let info = message.info().ok()?;
                Some(format!("{}:{}", info.stream, info.stream_sequence))
            })
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let source_subject = routed(crate::bus::parts::SOURCE_SUBJECT)
            .unwrap_or_else(|| message.subject.to_string());
        dead_letters::publish(
            &self.js,
            DeadLetter {
                reason: rejection.reason,
                error: &rejection.error,
                source_subject: &source_subject,
                headers: message.headers.as_ref(),
                body: message.payload.clone(),
                origin_id,
            },
        )
        .await
    }
}
